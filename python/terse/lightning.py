"""terse's DDP hook inside PyTorch Lightning: a Callback that registers it on the DDP model
Lightning makes::

    import lightning.pytorch as pl
    import terse.lightning

    terse_hook = terse.lightning.callback(codec="powersgd:rank=8")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[terse_hook])
    trainer.fit(module, data)
    terse_hook.state.bytes_sent

Lightning's own door, ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, registers the
hook only when training on CUDA devices, and terse's hook reduces CPU tensors: on CPU Lightning
would drop it without a word. The callback registers it in ``on_fit_start``, after the strategy
has initialized the process group and wrapped the module in DistributedDataParallel, on every
rank; the state connects there (codec ``"auto"`` calibrates there). ``state`` is a
:class:`terse.torch.TerseHookState` made with ``lazy=True`` when the callback is made, so a bad
knob fails before Lightning starts its ranks.

Works with ``lightning.pytorch`` (package ``lightning``) and with ``pytorch_lightning``: the
callback subclasses the Callback of the one imported (``lightning.pytorch`` when both or
neither are). Lightning is imported when :func:`callback` is called, not with this module.
"""

import sys
from typing import Any, Dict

from terse.torch import TerseHookState, register_on

__all__ = ["callback"]

_classes: Dict[str, type] = {}


def _lightning() -> Any:
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        import pytorch_lightning
        return pytorch_lightning
    try:
        import lightning.pytorch
        return lightning.pytorch
    except ImportError:
        try:
            import pytorch_lightning
            return pytorch_lightning
        except ImportError:
            raise ImportError("terse.lightning needs PyTorch Lightning "
                              "(pip install lightning)") from None


def _callback_class(pl: Any) -> type:

    class TerseDDPHook(pl.Callback):
        """Registers terse's DDP hook on the model Lightning wraps; ``state`` is its
        :class:`terse.torch.TerseHookState`."""

        def __init__(self, **knobs: Any) -> None:
            self.state = TerseHookState(None, lazy=True, **knobs)
            self._registered: Any = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            ddp = trainer.strategy.model
            if ddp is self._registered:
                return
            register_on(self.state, ddp, pl_module,
                        door="terse.lightning: the strategy's model",
                        needs="strategy='ddp' (or DDPStrategy) with 2 or more processes")
            self._registered = ddp

    TerseDDPHook.__qualname__ = TerseDDPHook.__name__
    return TerseDDPHook


def callback(**knobs: Any) -> Any:
    """A Lightning Callback that registers terse's DDP hook with these knobs
    (:class:`terse.torch.TerseHookState`'s: ``codec``, ``min_bytes``, ``warmup_steps``, ...);
    its ``state`` attribute is the hook's state. Give it to ``Trainer(callbacks=[...])``."""
    pl = _lightning()
    cls = _classes.get(pl.__name__)
    if cls is None:
        cls = _classes[pl.__name__] = _callback_class(pl)
    return cls(**knobs)
