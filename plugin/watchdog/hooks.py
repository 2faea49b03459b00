"""The engine's phase boundaries, marked in the ledger without the back ends knowing: module and optimizer hooks,
and the engine's public calls wrapped on the instance.

* ``train_step`` -> ``step`` (its batch), ``eval_step`` -> ``eval``, ``save`` / ``load`` -> ``checkpoint``; after
  each call, ``user`` (the training loop's own code, until the next call);
* a forward pre-hook on each module the back end runs once per micro-batch
  (:meth:`plugin.engines.base.Engine.micro_batch_modules`: the model, or each local pipeline stage) -> ``forward``
  of micro-batch k, and a hook on that forward's output tensor -> ``backward`` of micro-batch k when its gradient
  arrives (under 1F1B the two interleave, as they run);
* a step pre-hook on the torch optimizer the update reads (``schedule_optimizer()``) -> ``optimizer``;
* under pipeline stages, the point-to-point ops of the schedule -> ``recv`` / ``send`` of micro-batch k from / to
  stage j, with the rank that stage runs on: torch's ``PipelineStage.get_{fwd,bwd}_{recv,send}_ops`` on each of the
  native engine's stages, and DeepSpeed's pipeline instructions (its engine's ``_INSTRUCTION_MAP``, copied onto the
  instance with the send and receive entries marked). Gloo's flight recorder does not record point-to-point ops:
  this is how the report knows a stage waits for its neighbour.

Each hook replaces one tuple (:meth:`plugin.watchdog.ledger.Ledger.enter`): no collective, no lock, no store call;
``train_step`` also sets ``Ledger.stepped``, on which the heartbeat thread publishes the new step at once.
:meth:`EngineHooks.detach` removes them all.
"""
from __future__ import annotations

import torch

from .ledger import Ledger

WRAPPED = {"train_step": "step", "eval_step": "eval", "save": "checkpoint", "load": "checkpoint"}
# torch's PipelineStage method -> (phase, words, the stage it talks to relative to this one)
NATIVE_P2P = {"get_fwd_recv_ops": ("recv", "activations of micro-batch {k} from stage {j}", -1),
              "get_bwd_recv_ops": ("recv", "gradients of micro-batch {k} from stage {j}", 1),
              "get_fwd_send_ops": ("send", "activations of micro-batch {k} to stage {j}", 1),
              "get_bwd_send_ops": ("send", "gradients of micro-batch {k} to stage {j}", -1)}
# DeepSpeed's pipeline instruction (deepspeed.runtime.pipe.schedule) -> the same
DEEPSPEED_P2P = {"RecvActivation": ("recv", "activations from stage {j}", -1),
                 "RecvGrad": ("recv", "gradients from stage {j}", 1),
                 "SendActivation": ("send", "activations to stage {j}", 1),
                 "SendGrad": ("send", "gradients to stage {j}", -1)}


def _first_grad_tensor(output):
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if isinstance(output, dict):  # transformers' ModelOutput too
        return next((t for t in output.values() if isinstance(t, torch.Tensor) and t.requires_grad), None)
    return None


class EngineHooks:
    def __init__(self, engine, ledger: Ledger):
        self.engine, self.ledger = engine, ledger
        self.handles: list = []
        self.patched: list = []  # (object, attribute) set on instances, removed by detach

    def attach(self) -> None:
        ledger = self.ledger
        for module in self.engine.micro_batch_modules():
            self.handles.append(module.register_forward_pre_hook(self._forward))
            self.handles.append(module.register_forward_hook(self._after_forward))
        optimizer = self.engine.schedule_optimizer()
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self.handles.append(optimizer.register_step_pre_hook(lambda *_: ledger.enter("optimizer")))
        for name, phase in WRAPPED.items():
            setattr(self.engine, name, self._wrap(getattr(self.engine, name), phase, name == "train_step"))
        self._mark_pipeline_ops()

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for obj, name in [(self.engine, n) for n in WRAPPED] + self.patched:
            obj.__dict__.pop(name, None)
        self.patched.clear()

    def _peer(self, stage: int) -> int:
        """The global rank that runs pipeline stage ``stage`` (a virtual stage: ``stage mod pipeline``) for this rank's
        data and tensor coordinates."""
        ranks = self.engine.groups.pipeline_ranks
        return ranks[stage % len(ranks)]

    def _mark_pipeline_ops(self) -> None:
        for stage in getattr(self.engine, "stages", ()):  # the native engine's torch PipelineStages
            j = stage.stage_index
            for name, (phase, words, peer) in NATIVE_P2P.items():
                setattr(stage, name, self._marked_ops(getattr(stage, name), phase, words, j + peer))
                self.patched.append((stage, name))
        ds = getattr(self.engine, "ds", None)
        table = getattr(ds, "_INSTRUCTION_MAP", None) if getattr(self.engine, "pipelined", False) else None
        if table is not None:  # DeepSpeed's PipelineEngine looks its instructions up through self._INSTRUCTION_MAP
            ds._INSTRUCTION_MAP = {kind: self._marked_instruction(run, *DEEPSPEED_P2P[kind.__name__])
                                   if kind.__name__ in DEEPSPEED_P2P else run for kind, run in table.items()}
            self.patched.append((ds, "_INSTRUCTION_MAP"))

    def _marked_ops(self, get_ops, phase: str, words: str, stage: int):
        """``PipelineStage.get_*_ops(chunk)``, marking ``phase`` when it returns ops (the first stage receives no
        activations, the last no gradients): the schedule runs them next and waits."""
        ledger, peer = self.ledger, self._peer(stage)

        def marked(chunk):
            ops = get_ops(chunk)
            if ops:
                ledger.enter(phase, words.format(k=chunk + 1, j=stage), peer)
            return ops
        return marked

    def _marked_instruction(self, run, phase: str, words: str, towards: int):
        """One of DeepSpeed's pipeline instructions (a function of the engine), marking ``phase`` first."""
        ledger = self.ledger

        def marked(engine, *args, **kwargs):
            j = engine.stage_id + towards
            ledger.enter(phase, words.format(j=j), self._peer(j))
            return run(engine, *args, **kwargs)
        return marked

    def _wrap(self, call, phase: str, is_step: bool):
        ledger, engine = self.ledger, self.engine

        def wrapped(*args, **kwargs):
            if is_step:
                ledger.forwards = 0
            ledger.enter(phase)
            if is_step:
                ledger.stepped.set()
            result = call(*args, **kwargs)  # an exception leaves the phase it came from in the ledger (the report's)
            ledger.step = engine.step_count
            ledger.enter("user")
            return result

        wrapped.__wrapped__ = call
        wrapped.__doc__ = call.__doc__
        return wrapped

    def _forward(self, module, args):
        if torch.is_grad_enabled():
            self.ledger.forwards += 1
            self.ledger.enter("forward", f"micro-batch {self.ledger.forwards}")

    def _after_forward(self, module, args, output):
        if not torch.is_grad_enabled():
            return
        t = _first_grad_tensor(output)
        if t is not None:
            k, ledger = self.ledger.forwards, self.ledger
            t.register_hook(lambda grad: ledger.enter("backward", f"micro-batch {k}"))
