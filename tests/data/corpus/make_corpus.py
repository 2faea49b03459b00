"""Make stdlib_docs.jsonl: the docstrings of Python's standard library (module, class and function docstrings over
50 characters, read with ast: nothing imported), one JSON line each, {"text", "source"}, about 2 MB. PSF licence:
LICENSE.txt next to it. Also trains the 512-token byte-level BPE in ../tokenizer (deterministic).

    python tests/data/corpus/make_corpus.py
"""
import ast
import json
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT = 2_000_000


def docstrings():
    lib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.glob("*.py")) + sorted(lib.glob("*/*.py")):
        if "test" in path.parts[-2:-1] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        module = path.relative_to(lib).with_suffix("").as_posix().replace("/", ".")
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 50:
                    yield doc, f"{module}:{getattr(node, 'name', '')}"


def main():
    size, seen = 0, set()
    with open(HERE / "stdlib_docs.jsonl", "w", encoding="utf-8") as f:
        for text, source in docstrings():
            if text in seen:
                continue
            seen.add(text)
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            size += len(line.encode())
            if size > LIMIT:
                break
            f.write(line)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [json.loads(line)["text"] for line in open(HERE / "stdlib_docs.jsonl", encoding="utf-8")]
    tok.train_from_iterator(texts, trainer)
    out = HERE.parent / "tokenizer"
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}) + "\n")


if __name__ == "__main__":
    main()
