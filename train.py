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
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

import plugin
from plugin.checkpoint.directory import step_name
from plugin.data.text import TextBatches
from plugin.elastic.ledger import Heartbeat
from plugin.elastic.resume import AUTO, resume_from, resume_problem
from plugin.elastic.standby import stand_by
from plugin.elastic.world import follow_world, shared_store_warning
from plugin.errors import PluginError, RecipeError
from plugin.job.interrupt import GRACE_S, Interrupts
from plugin.job.lock import JobLockedError, SaveLock, run_id, used_refusal
from plugin.launch.launcher import check_train_script
from plugin.monitor import tensorboard
from plugin.monitor.console import Console
from plugin.monitor.metrics import MetricsFile
from plugin.monitor.quiet import quiet_engines
from plugin.tensor_parallel.random import offset_default_stream_by_stage


def parse_args(argv=None):
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
    p.add_argument("--eval-every", type=int, metavar="N", help="evaluate on held-out windows every N steps (and "
                   "always after the last step)")
    p.add_argument("--eval-batches", type=int, default=4, metavar="K",
                   help="held-out global batches per evaluation (default 4)")
    p.add_argument("--tensorboard", metavar="DIR", help="rank 0 writes TensorBoard scalars (and the recipe and "
                   "layout as text) to DIR (pip install 'parallel-recipe[monitor]')")
    p.add_argument("--log-every", type=int, metavar="N", help="without a terminal, print a line every N steps "
                   "(default: every tenth of the run)")
    p.add_argument("--verbose", action="store_true", help="keep the engines' own log lines (DeepSpeed's INFO and "
                   "WARNING lines and prints) in the output")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint there after the last step "
                   "(DIR/step-00000050, DIR/latest)")
    p.add_argument("--save-every", type=int, metavar="N", help="also save every N steps (needs --save)")
    p.add_argument("--keep", type=int, metavar="K", help="keep the last K complete checkpoints under --save")
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
    return p.parse_args(argv)


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


def main(argv=None):
    args = parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"  # before any process group: the launcher's word
    # first: a Ctrl-C during start-up ends quietly; once training, a signal stops at the next step boundary
    interrupts = Interrupts(grace_s=args.grace, launched="RANK" in os.environ,
                            say=(lambda line: print(line, file=sys.stderr, flush=True)) if rank0 else None).install()
    held = []  # the --save lock, released however this ends
    interrupts.on_exit.append(lambda: [lock.release() for lock in held])
    try:
        return train(args, interrupts, held, rank0)
    finally:
        for lock in held:
            lock.release()
        interrupts.uninstall()


def train(args, interrupts, held, rank0):
    if (args.save_every or args.keep) and not args.save:  # before any process group: every rank exits alike
        print("--save-every and --keep need --save DIR", file=sys.stderr)
        return 2
    if args.elastic:
        other = args.resume not in (None, AUTO)
        if other or not args.save:
            print("--elastic resumes every restart from --save's latest complete step: give --save DIR"
                  + (f" (and no --resume {args.resume})" if other else ""), file=sys.stderr)
            return 2
        args.resume = AUTO
    problem = resume_problem(args.resume, args.save)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    counts = {"--save-every": args.save_every, "--keep": args.keep, "--eval-every": args.eval_every,
              "--eval-batches": args.eval_batches, "--log-every": args.log_every}
    if any(v is not None and v < 1 for v in counts.values()):
        print(f"{', '.join(k for k, v in counts.items() if v is not None and v < 1)}: take a number of at least 1",
              file=sys.stderr)
        return 2
    if args.tensorboard and tensorboard.missing():  # before any process group: every rank exits alike
        print(tensorboard.missing(), file=sys.stderr)
        return 2
    if args.save:  # one job per directory: rank 0 takes its lock, before any process group (plugin.job.lock)
        try:
            if rank0:
                held.append(SaveLock(args.save, run_id()).acquire())
        except JobLockedError as e:
            print(e, file=sys.stderr)
            return 2
        refused = used_refusal(args.save, resume=bool(args.resume))  # a fresh run would drop another run's steps
        if refused:
            if rank0:
                print(refused, file=sys.stderr)
            return 2
    try:
        recipe = plugin.load_recipe(args.recipe)
    except RecipeError as e:
        print("\n".join(p.format() for p in e.errors), file=sys.stderr)
        return 2
    problems = check_train_script(recipe)  # launch.sh refuses the same up front
    if problems:
        print("\n".join(p.format() for p in problems), file=sys.stderr)
        return 2
    if args.elastic:  # before any process group: the surplus ranks leave, the others build their groups alone
        try:
            world = follow_world(recipe, os.environ)
        except RecipeError as e:
            if os.environ.get("RANK", "0") == "0":
                print("\n".join(p.format() for p in e.problems), file=sys.stderr)
            return 2
        if not world.trains:
            if world.rank == world.usable:
                print(world.sit_out_line(recipe.name), file=sys.stderr, flush=True)
            return stand_by(args.save, args.steps, os.environ) if world.stands_by else 0  # keeps its node in the job
        os.environ["WORLD_SIZE"] = str(world.usable)
        warning = shared_store_warning(os.environ)
        if warning and world.rank == 0:
            print(warning, file=sys.stderr)
    resume = resume_from(args.resume, args.save)  # --resume auto: None on a fresh start
    heartbeat = Heartbeat(args.save, os.environ.get("TORCHELASTIC_RUN_ID", "")) if args.resume == AUTO else None
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    windows = None
    if args.data:
        try:
            windows = local_windows(args, recipe)
        except PluginError as e:
            print(e, file=sys.stderr)
            return 2
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
        if os.environ.get("RANK", "0") == "0":
            print("\n".join(p.with_file(recipe.source).format() for p in e.problems), file=sys.stderr)
        return 2
    except PluginError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        engine = plugin.initialize(model, recipe, seed=args.seed, weights=saved_weights(args.model), job_dir=args.save)
    except RecipeError:
        return 2  # rank 0 already printed every problem
    except PluginError as e:
        print(e, file=sys.stderr)
        return 2
    offset_default_stream_by_stage(engine.groups.pp_rank)  # each stage its own dropout masks (Megatron's seeds)

    data = TextBatches(recipe.model.vocab, recipe.model.seq_len, seed=args.seed)  # its own generator
    try:
        state = engine.load(resume) if resume else {"step": 0}
        start = state["step"]
        if windows is not None:  # the same global batch at step i whatever the layout; the position in checkpoints
            loader = engine.dataloader(windows[0], seed=args.seed)
            if "data" in state:
                loader.load_state_dict(state["data"])
            elif start:  # restarting the data at step N would train epoch 0's rows again, exit 0
                raise PluginError(f"--resume {resume}: the checkpoint (step {start}) holds no --data position "
                                  "-> resume with the data it was trained on, or start without --resume")
    except PluginError as e:  # every rank reads the same checkpoint and reaches the same verdict
        print(e, file=sys.stderr)
        engine.close()
        return 2
    if windows is not None:
        stream = loader.stream()
        next_batch = lambda step: next(stream)  # noqa: E731
    else:
        next_batch = lambda step: data.global_batch(step, engine.layout.global_batch)  # noqa: E731
    held_out = held_out_batches(engine, data, windows, args.eval_batches)

    def save_kwargs():  # the data position travels in the checkpoint, so --resume continues where it stopped
        return {"keep": args.keep, "client_state": {"data": loader.state_dict()} if windows is not None else None}
    main_rank = engine.is_main
    if heartbeat is not None:
        heartbeat.begin(main_rank, engine.layout.data, engine.topology.world_size)
        if main_rank:
            print(f"resume auto: start {heartbeat.start} of the run in {args.save} (torchrun restart "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')}): "
                  + (f"from step {start} ({resume})" if resume else "no complete checkpoint there, a fresh start"),
                  file=sys.stderr)
    metrics = None
    if args.metrics and (main_rank or "{rank}" in args.metrics):
        metrics = MetricsFile(args.metrics, engine.rank, resumed_at=start if args.resume else None,
                              extra={"restart": heartbeat.start} if heartbeat is not None else None)
    board = tensorboard.TensorBoard(args.tensorboard, recipe, engine.describe(),
                                    resumed_at=start if args.resume else None) if args.tensorboard and main_rank \
        else None
    console = Console(args.steps, start, enabled=main_rank, log_every=args.log_every)
    engine.stop_request = interrupts.is_requested  # every rank learns of any rank's after each step
    interrupts.training()
    losses, eval_loss, elapsed, stopped = [], None, 0.0, None
    for step in range(start, args.steps):
        loss = engine.train_step(next_batch(step))
        losses.append(loss)
        recovered = heartbeat.beat(step + 1, time.time()) if heartbeat is not None else None
        if recovered and main_rank:
            print(recovered, file=sys.stderr, flush=True)
        elapsed += engine.last_step.step_time_s
        last = step + 1 == args.steps
        stop = engine.last_step.stop_requested  # the same on every rank: each reached this step's end
        saving = args.save and (last or stop or (args.save_every and (step + 1) % args.save_every == 0))
        if saving:
            engine.save(args.save, **save_kwargs())  # before evaluating: a checkpoint holds what training left
        evaluated = not stop and (last or bool(args.eval_every and (step + 1) % args.eval_every == 0))
        eval_loss = evaluate(engine, held_out) if evaluated else None
        for out in (console, metrics, board):
            if out is not None:
                out.write(engine.last_step, eval_loss)
        if stop:
            stopped = engine.step_count
            break
    console.close()
    if stopped is not None:  # a signal (or the launcher's exit): this step saved, one line, no evaluation
        if main_rank:
            saved = (f"saved {Path(args.save) / step_name(stopped)}; resume with --resume {args.save}" if args.save
                     else "nothing saved (no --save)")
            print(f"interrupted at step {stopped}; {saved}", file=sys.stderr, flush=True)
        for out in (metrics, board):
            if out is not None:
                out.close()
        interrupts.done()
        engine.close()
        return interrupts.exit_code()
    if eval_loss is None:  # no step ran (resumed at --steps): still say how the model does
        eval_loss = evaluate(engine, held_out)
    if main_rank and losses:
        lay = engine.layout
        tokens = lay.global_batch * recipe.model.seq_len * len(losses)
        print(f"\ntrained {recipe.name} with {engine.backend}: data {lay.data} x tensor {lay.tensor} x pipeline "
              f"{lay.pipeline}, ZeRO-{recipe.zero.stage}, {recipe.precision}\n"
              f"  steps {start + 1}-{args.steps}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, eval loss {eval_loss:.4f}\n"
              f"  {tokens / elapsed:,.0f} tokens/s over {elapsed:.1f} s of steps"
              + (f"; checkpoint in {args.save}" if args.save else ""), file=sys.stderr)
    for out in (metrics, board):
        if out is not None:
            out.close()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
