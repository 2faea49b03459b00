"""Local data (plugin.data.files / tokenizer / packing) and train.py --data / --tokenizer on one process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

from plugin.data.files import read_documents  # noqa: E402
from plugin.data.packing import check_enough, pack  # noqa: E402
from plugin.data.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from plugin.errors import PluginError  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data"
CORPUS = DATA / "corpus" / "stdlib_docs.jsonl"
TOKENIZER = DATA / "tokenizer"


@pytest.fixture(scope="module")
def few(tmp_path_factory):
    """The shipped corpus's first 40 documents as JSONL, text and Parquet (a 'content' field), and a bad JSONL."""
    tmp = tmp_path_factory.mktemp("docs")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:40]
    texts = [json.loads(line)["text"] for line in lines]
    (tmp / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp / "b.txt").write_text(texts[0], encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": texts[:5]}), tmp / "c.parquet")
    (tmp / "empty.jsonl").write_text("")
    return tmp, texts


def test_jsonl_text_and_parquet_documents(few):
    tmp, texts = few
    assert read_documents([tmp / "a.jsonl"]) == texts
    assert read_documents([tmp / "b.txt"]) == [texts[0]]  # a text file is one document, not one per line
    assert read_documents([tmp / "c.parquet"], text_field="content") == texts[:5]


def test_bad_input_is_refused_with_the_fix(few):
    tmp, _ = few
    with pytest.raises(PluginError, match="no such file"):
        read_documents([tmp / "missing.jsonl"])
    with pytest.raises(PluginError, match="empty dataset"):
        read_documents([tmp / "empty.jsonl"])
    with pytest.raises(PluginError, match=r"has no field 'text'; its fields: content -> --text-field content"):
        read_documents([tmp / "c.parquet"])
    (tmp / "x.csv").write_text("a,b\n")
    with pytest.raises(PluginError, match="unknown file type .csv"):
        read_documents([tmp / "x.csv"])


def test_tokenizers_and_their_vocabulary_check():
    tok = load_tokenizer(TOKENIZER, model_vocab=512)
    assert tok.vocab_size == 512 and tok.eos_id == tok.tok.token_to_id("<|endoftext|>")
    ids = tok.encode(["Return the sum of a and b."])[0]
    assert tok.tok.decode(ids) == "Return the sum of a and b." and tok.eos_id not in ids
    with pytest.raises(PluginError, match="512 tokens, more than the model's vocabulary 128 -> set model.vocab"):
        load_tokenizer(TOKENIZER, model_vocab=128)
    assert ByteTokenizer().encode(["hé"]) == [[104, 195, 169]]
    with pytest.raises(PluginError, match="byte-level tokenizer"):
        load_tokenizer(None, model_vocab=128)


def test_packing_puts_eos_between_documents_and_drops_the_tail():
    windows = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], eos_id=0, seq_len=4)
    assert windows.windows.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert set(windows[1]) == {"input_ids", "labels"} and torch.equal(windows[1]["labels"], windows[1]["input_ids"])
    with pytest.raises(PluginError, match=r"12 tokens = 3 windows of seq_len 4, fewer than one global batch \(16"):
        check_enough(windows, 4, 16)


def test_train_py_trains_on_local_jsonl_with_a_local_tokenizer_and_resumes(few, tmp_path, capsys):
    pytest.importorskip("transformers")
    import train
    from plugin.recipe.load import find_recipe

    data = json.loads(find_recipe("cpu_single").read_text())
    data.pop("$schema", None)
    data["model"] = {**data["model"], "vocab": 512, "seq_len": 32, "layers": 2}
    data["launcher"] = "torchrun"  # the native back end: several train.main in one process (DeepSpeed keeps groups)
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps(data))
    args = ["--recipe", str(recipe), "--data", str(few[0] / "a.jsonl"), "--tokenizer", str(TOKENIZER)]
    assert train.main([*args, "--steps", "4", "--metrics", str(tmp_path / "all.jsonl")]) == 0
    assert train.main([*args, "--steps", "2", "--save", str(tmp_path / "ck")]) == 0
    assert train.main([*args, "--steps", "4", "--resume", str(tmp_path / "ck"),
                       "--metrics", str(tmp_path / "resumed.jsonl")]) == 0
    losses = [json.loads(x)["loss"] for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    resumed = [json.loads(x)["loss"] for x in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert resumed == losses[2:]  # the data position came back with the checkpoint
    capsys.readouterr()
    assert train.main(["--recipe", "cpu_single", *args[2:]]) == 2  # vocab 128 < the tokenizer's 512
    assert "more than the model's vocabulary 128" in capsys.readouterr().err
    assert train.main([*args[:2], "--data", str(few[0] / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
