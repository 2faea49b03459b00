"""Train with a parallel recipe. The same script under every launcher:

    python train.py --recipe cpu_single                         # one process, the reference
    deepspeed --num_gpus 4 train.py --recipe cpu_dp4            # DeepSpeed's launcher (CPU: gloo)
    torchrun --nproc_per_node 4 train.py --recipe cpu_tp2_dp2
    accelerate launch --multi_gpu --num_processes 4 train.py --recipe cpu_dp4
    ./launch.sh cpu_tp2_pp2                                     # picks one of the above

Data: byte-level text of Python's standard library (no download), or with --data your local text / JSONL /
Parquet files (--tokenizer DIR for a tokenizer.json), packed into seq_len windows; the same global batch at step
i whatever the layout, and --save keeps the data position for --resume. Rank 0 shows each step (loss, lr, gradient
norm, tokens/s, MFU, memory, ETA: one live line on a terminal, a line every --log-every steps otherwise), writes
--metrics as JSON lines and --tensorboard scalars, evaluates on held-out windows every --eval-every steps and at the
end, and prints a summary. DeepSpeed's own log lines stay out of the console unless --verbose.

Reading order: parse_args (every rule on the flags), main (the job's life: signals, the --save lock), train (start-up,
then the loop). The job's bookkeeping lives in plugin.job: Job (signals, lock), Saves (--save/--resume), Restarts
(elastic starts, --resume auto's heartbeat). The imports up here are torch-free: torch is imported by build_engine,
so a start refused before it (a second job on a --save directory: rank 0) ends before that import.
"""
import argparse
import gc
import itertools
import os
import sys
from pathlib import Path

import plugin
from plugin.elastic.resume import AUTO, resume_problem
from plugin.elastic.standby import stand_by
from plugin.errors import PluginError, RecipeError
from plugin.job.interrupt import GRACE_S
from plugin.job.life import Job, say_line
from plugin.job.outputs import metrics_problem
from plugin.job.restarts import Restarts, elastic_start
from plugin.job.saves import Saves
from plugin.launch.launcher import check_train_script
from plugin.monitor import tensorboard
from plugin.monitor.console import Console
from plugin.monitor.metrics import MetricsFile
from plugin.monitor.quiet import quiet_engines


def positive(text: str) -> int:
    """A flag that counts steps or batches: a whole number of at least 1 (argparse names the flag)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes a number of at least 1, not {n}")
    return n


def parse_args(argv=None):
    """The flags and every rule between them: argparse's error (usage, the rule, exit 2), alike on every rank and
    before any process group."""
    p = argparse.ArgumentParser(description="Train a model with a parallel recipe.")
    p.add_argument("--recipe", required=True, help="a recipe path or a shipped recipe's name (cpu_dp4)")
    p.add_argument("--steps", type=int, default=50, help="train until this optimizer step (default 50)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--init", choices=["meta", "eager"], default="meta",
                   help="meta (default): build on the meta device, each rank materialises only what it holds; "
                        "eager: build the whole model on every rank first (the same values)")
    p.add_argument("--metrics", help="rank 0 writes JSON lines here: step, loss, tokens_per_s, lr, grad_norm, tokens, "
                   "step_time_s, memory_gb, mfu (and eval_loss on evaluation steps); a path with {rank} in it: every "
                   "rank writes its own")
    p.add_argument("--eval-every", type=positive, metavar="N", help="evaluate on held-out windows every N steps (and "
                   "always after the last step)")
    p.add_argument("--eval-batches", type=positive, default=4, metavar="K",
                   help="held-out global batches per evaluation (default 4)")
    p.add_argument("--tensorboard", metavar="DIR", help="rank 0 writes TensorBoard scalars (and the recipe and "
                   "layout as text) to DIR (pip install 'parallel-recipe[monitor]')")
    p.add_argument("--log-every", type=positive, metavar="N", help="without a terminal, print a line every N steps "
                   "(default: every tenth of the run)")
    p.add_argument("--verbose", action="store_true", help="keep the engines' own log lines (DeepSpeed's INFO and "
                   "WARNING lines and prints) in the output")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint there after the last step "
                   "(DIR/step-00000050, DIR/latest)")
    p.add_argument("--save-every", type=positive, metavar="N", help="also save every N steps (needs --save)")
    p.add_argument("--keep", type=positive, metavar="K", help="keep the last K complete checkpoints under --save")
    p.add_argument("--resume", metavar="DIR|auto", help="resume from the last complete checkpoint under DIR (a save "
                   "of step s then removes the checkpoints of steps above s under --save: an abandoned timeline); "
                   "auto: from --save's latest complete step when it has one, else start fresh (one command line "
                   "for every restart; metrics then carry the run's restart count)")
    p.add_argument("--elastic", action="store_true", help="follow a world that changes between restarts (torchrun "
                   "--nnodes MIN:MAX, launch.sh --elastic): the recipe needs \"data\": \"auto\" and batch.global; "
                   "each start trains on the most launched processes the recipe can use, the rest exit 0 at once; "
                   "needs --save DIR and resumes as --resume auto")
    p.add_argument("--grace", type=float, default=GRACE_S, metavar="SECONDS",
                   help=f"after SIGINT/SIGTERM, the time to finish the step and save it (default {GRACE_S:g}; "
                   "below the 30 s torchrun and deepspeed wait before SIGKILL)")
    p.add_argument("--model", default="gpt",
                   help="gpt: the reference GPT; a transformers causal-LM model_type (llama, qwen3, gemma2, mixtral, "
                   "...): that family sized by the recipe's model block; or a config.json path (random weights; must "
                   "agree with the recipe); or a save_pretrained directory (config.json + *.safetensors): its weights, "
                   "each rank reading its part")
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="local text / JSONL / Parquet files or directories, packed into seq_len windows "
                   "(default: the standard library's text, byte-level)")
    p.add_argument("--text-field", default="text", help="the JSONL / Parquet field holding the text (default text)")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with a tokenizer.json (default: byte-level)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed passes it
    args = p.parse_args(argv)
    if (args.save_every or args.keep) and not args.save:
        p.error("--save-every and --keep need --save DIR")
    if args.elastic:  # every restart of an elastic job resumes where the last one saved
        other = args.resume not in (None, AUTO)
        if other or not args.save:
            p.error("--elastic resumes every restart from --save's latest complete step: give --save DIR"
                    + (f" (and no --resume {args.resume})" if other else ""))
        args.resume = AUTO
    problem = resume_problem(args.resume, args.save)
    if problem:
        p.error(problem)
    return args


def local_windows(args, recipe):
    """--data's documents tokenised and packed, split (train, eval), checked before any process group exists."""
    from plugin.data.files import read_documents
    from plugin.data.packing import check_enough, pack
    from plugin.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer, model_vocab=recipe.model.vocab)
    windows = pack(tok.encode(read_documents(args.data, args.text_field)), tok.eos_id, recipe.model.seq_len)
    train, evaluation = windows.split(0.1)
    global_batch = recipe.layout(int(os.environ.get("WORLD_SIZE", "1"))).global_batch
    check_enough(train, recipe.model.seq_len, global_batch)
    return train, evaluation


def saved_weights(name):
    """--model DIR where DIR holds weights next to its config.json (save_pretrained's output): DIR, else None."""
    d = Path(name)
    return str(d) if d.is_dir() and (any(d.glob("*.safetensors")) or any(d.glob("*.bin"))) else None


def build_model(name, dims):
    if name == "gpt":
        from plugin.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig.from_recipe_model(dims))
    from plugin.models.hf import build_hf_model

    return build_hf_model(name, dims)


def held_out_batches(engine, data, windows, count: int) -> list:
    """``count`` global batches nobody trains on (fewer if the held-out windows run out): the last tenth of the
    standard library's text, or of --data's windows (the training windows when the held-out part is smaller than
    one global batch). The same rows on every layout; each rank takes its share."""
    rows = engine.layout.global_batch
    if windows is None:
        return [data.global_batch(i, rows, split="eval") for i in range(count)]
    held = windows[1] if len(windows[1]) >= rows else windows[0]
    return [{"input_ids": w, "labels": w} for w in (held.windows[i * rows:(i + 1) * rows]
                                                     for i in range(min(count, len(held) // rows)))]


def evaluate(engine, batches) -> float:
    """The mean loss over the held-out batches (each one global batch's mean)."""
    return sum(engine.eval_step(b) for b in batches) / len(batches)


def summary(recipe, engine, first: int, last: int, losses, eval_loss: float, elapsed: float, save) -> str:
    """Rank 0's closing lines: back end, layout, the first and last loss, the eval loss, tokens per second."""
    lay = engine.layout
    tokens = lay.global_batch * recipe.model.seq_len * len(losses)
    return (f"\ntrained {recipe.name} with {engine.backend}: {lay.words}, ZeRO-{recipe.zero.stage}, "
            f"{recipe.precision}\n"
            f"  steps {first}-{last}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, eval loss {eval_loss:.4f}\n"
            f"  {tokens / elapsed:,.0f} tokens/s over {elapsed:.1f} s of steps"
            + (f"; checkpoint in {save}" if save else ""))


def read_recipe(args, job):
    """The recipe, every problem at once, and what train.py needs beyond a valid one (launch.sh refuses the same up
    front): a refusal on every rank, before any process group."""
    try:
        recipe = plugin.load_recipe(args.recipe)
    except RecipeError as e:
        job.refuse("\n".join(p.format() for p in e.errors))
    problems = check_train_script(recipe)
    if problems:
        job.refuse("\n".join(p.format() for p in problems))
    return recipe


def build_engine(args, recipe, job):
    """The model (built on the meta device unless --init eager) handed to plugin.initialize, which creates the process
    groups and the engine; a refusal before them wherever it can be."""
    import torch  # not at the top: a refused start (the --save lock, a flag, the recipe) ends before its import

    from plugin.tensor_parallel.random import offset_default_stream_by_stage

    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:  # the node's cores shared by its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if not args.verbose:
        quiet_engines()  # DeepSpeed's INFO/WARNING lines and prints stay out of the console from here on
    torch.manual_seed(args.seed)  # --init eager: the same whole model on every rank (meta: seed= below)
    try:
        if args.init == "meta":  # each rank then materialises only what it holds (plugin.initialize)
            with torch.device("meta"):
                model = build_model(args.model, recipe.model)
        else:
            model = build_model(args.model, recipe.model)
    except RecipeError as e:  # the recipe and --model's config disagree: every process exits, before any group
        job.refuse("\n".join(p.with_file(recipe.source).format() for p in e.problems), everyone=False)
    except PluginError as e:
        job.refuse(str(e))
    try:
        engine = plugin.initialize(model, recipe, seed=args.seed, weights=saved_weights(args.model), job_dir=args.save)
    except RecipeError:
        raise SystemExit(2) from None  # rank 0 already printed every problem
    except PluginError as e:
        job.refuse(str(e))
    offset_default_stream_by_stage(engine.groups.pp_rank)  # each stage its own dropout masks (Megatron's seeds)
    return engine


def step_outputs(args, recipe, engine, start: int, saves, restarts) -> list:
    """What each step is written to: --metrics (rank 0's, or every rank's with {rank}), --tensorboard and the
    console line (rank 0's)."""
    main_rank = engine.is_main
    out = []
    if args.metrics and (main_rank or "{rank}" in args.metrics):
        out.append(MetricsFile(args.metrics, engine.rank, resumed_at=saves.resumed_at(start),
                               extra={"restart": restarts.start} if restarts is not None else None))
    if args.tensorboard and main_rank:
        out.append(tensorboard.TensorBoard(args.tensorboard, recipe, engine.describe(),
                                           resumed_at=saves.resumed_at(start)))
    return out + [Console(args.steps, start, enabled=main_rank, log_every=args.log_every)]


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.tensorboard and tensorboard.missing():  # before any process group: every rank exits alike
            print(tensorboard.missing(), file=sys.stderr)
            return 2
        # first: signals (a Ctrl-C during start-up ends quietly, once training it stops at the next step boundary)
        # and one job per --save directory (rank 0's lock), both given back however this ends (plugin.job)
        with Job(args.save, resume=args.resume, grace_s=args.grace) as job:
            return train(args, job)
    except SystemExit as e:  # argparse's error and job.refuse (exit 2), a signal during start-up (128 + its number)
        return e.code


def train(args, job):
    recipe = read_recipe(args, job)
    try:
        world = elastic_start(recipe, os.environ, say_line) if args.elastic else None  # before any process group
        if world is not None and not world.trains:  # this start's surplus: the others train without it; a node
            # that trains none keeps one process, so that torch's agent keeps the node for the next restart
            return stand_by(args.save, args.steps, os.environ) if world.stands_by else 0
    except RecipeError as e:  # the recipe cannot follow this world: every rank knows, rank 0 says it
        job.refuse("\n".join(p.format() for p in e.problems), everyone=False)
    problem = metrics_problem(args.metrics, os.environ) if args.metrics else None  # its writer makes its directory
    if problem:
        job.refuse(problem)
    saves = Saves(args.save, every=args.save_every, keep=args.keep, resume=args.resume)  # --resume auto reads --save
    restarts = Restarts(args.save, os.environ) if args.resume == AUTO else None  # every rank reads before rank 0 writes
    try:
        windows = local_windows(args, recipe) if args.data else None
    except PluginError as e:
        job.refuse(str(e))
    engine = build_engine(args, recipe, job)

    from plugin.data.text import TextBatches  # torch's: imported by build_engine, once the start is not refused
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len, seed=args.seed)  # its own generator
    try:  # the same global batch at step i whatever the layout; with --data its position travels in the checkpoints
        loader = engine.dataloader(windows[0], seed=args.seed) if windows is not None else None
        start = saves.load(engine, loader)
    except PluginError as e:  # every rank reads the same checkpoint and reaches the same verdict
        engine.close()
        job.refuse(str(e))
    batches = loader.stream() if loader is not None else \
        (data.global_batch(s, engine.layout.global_batch) for s in itertools.count(start))
    held_out = held_out_batches(engine, data, windows, args.eval_batches)
    if restarts is not None:
        restarts.begin(engine, start, saves.resume_dir, say_line)
    outputs = step_outputs(args, recipe, engine, start, saves, restarts)
    job.training(engine)  # from here a signal asks for a stop at the next step boundary, the same on every rank

    losses, eval_loss, elapsed, stopped = [], None, 0.0, None
    for step in range(start + 1, args.steps + 1):
        losses.append(engine.train_step(next(batches)))
        if restarts is not None:
            restarts.beat(step, say_line)
        elapsed += engine.last_step.step_time_s
        last = step == args.steps
        stop = engine.last_step.stop_requested  # the same on every rank: each reached this step's end
        if saves.due(step, last=last, stop=stop):
            saves.save(engine)  # before evaluating: a checkpoint holds what training left
        evaluated = not stop and (last or bool(args.eval_every and step % args.eval_every == 0))
        eval_loss = evaluate(engine, held_out) if evaluated else None
        for output in outputs:
            output.write(engine.last_step, eval_loss)
        if stop:
            stopped = engine.step_count
            break
    for output in outputs:
        output.close()

    if stopped is not None:  # a signal (or the launcher's exit): this step saved, one line, no evaluation
        if engine.is_main:
            say_line(saves.stopped_line(stopped))
        code = job.stopped()  # the grace period's timer ends here, before the engine's own shutdown
        engine.close()
        return code
    if eval_loss is None:  # no step ran (resumed at --steps): still say how the model does
        eval_loss = evaluate(engine, held_out)
    if engine.is_main and losses:
        print(summary(recipe, engine, start + 1, args.steps, losses, eval_loss, elapsed, args.save), file=sys.stderr)
    engine.close()
    return 0


if __name__ == "__main__":
    code = main()
    gc.freeze()  # the interpreter's teardown then skips torch's ~300k objects: seconds sooner gone, after a stop too
    sys.exit(code)
