"""terse's DDP hook inside the Hugging Face Trainer::

    import transformers
    import terse.hf

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    state = terse.hf.register(trainer, codec="powersgd:rank=8")
    trainer.train()
    state.bytes_sent

The Trainer wraps the model in DistributedDataParallel inside ``train()`` (through Accelerate),
so the hook cannot be registered before; :func:`register` adds a TrainerCallback whose
``on_train_begin`` registers it on ``trainer.model_wrapped`` on every rank, and connects the
state there (codec ``"auto"`` calibrates there). The state is a
:class:`terse.torch.TerseHookState` made with ``lazy=True``, so a bad knob fails at once.

Accelerate alone needs no adapter: register the hook on what ``accelerator.prepare`` returns
(docs/python.md). transformers is imported when :func:`register` is called, not with this
module.
"""

from typing import Any, Optional

from terse.torch import TerseHookState, register_on

__all__ = ["register"]

_class: Optional[type] = None


def _callback_class() -> type:
    try:
        import transformers
    except ImportError:
        raise ImportError("terse.hf needs transformers (pip install transformers)") from None

    class TerseDDPHook(transformers.TrainerCallback):
        """Registers ``state``'s hook on the Trainer's DDP model when training begins."""

        def __init__(self, trainer: Any, state: TerseHookState) -> None:
            self.trainer = trainer
            self.state = state
            self._registered: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ddp = self.trainer.model_wrapped
            if ddp is self._registered:
                return
            register_on(self.state, ddp, self.trainer.model,
                        door="terse.hf: the Trainer's model_wrapped",
                        needs="2 or more processes (torchrun or accelerate launch) on CPU, "
                              "without FSDP or DeepSpeed")
            self._registered = ddp

    TerseDDPHook.__qualname__ = TerseDDPHook.__name__
    return TerseDDPHook


def register(trainer: Any, **knobs: Any) -> TerseHookState:
    """Makes terse's DDP hook state with these knobs (:class:`terse.torch.TerseHookState`'s)
    and adds to ``trainer`` the callback that registers it when training begins; returns the
    state. Call it on every rank, before ``trainer.train()``."""
    global _class
    if _class is None:
        _class = _callback_class()
    state = TerseHookState(None, lazy=True, **knobs)
    trainer.add_callback(_class(trainer, state))
    return state
