"""The models ``fastload serve`` and ``fastload bench serve`` can run: torchvision's, or a simulated device.

Owns: ``build_model`` (a torchvision classification model by name, randomly initialised or
from a state_dict; nothing is downloaded) and ``SimulatedDevice``: a model that sleeps a
fixed cost plus a per-item cost per batch (``--batch-ms A+B*n``), freeing the CPU while it
"computes" as a GPU does, so a CPU machine shows the batching gain a GPU would get.

Must not: import ``measure/`` (``serve/`` stands beside it).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from fastload.errors import ServeError

__all__ = ["SimulatedDevice", "parse_batch_ms", "build_model"]

_BATCH_MS = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(?:\+\s*([0-9]*\.?[0-9]+)\s*\*\s*n\s*)?")


def parse_batch_ms(text: str) -> tuple[float, float]:
    """``"A+B*n"`` (or ``"A"``) → ``(A, B)`` in milliseconds.

    Raises:
        ServeError: any other form.
    """
    m = _BATCH_MS.fullmatch(text or "")
    if m is None:
        raise ServeError(f"--batch-ms must look like 'A+B*n' (ms per batch of n: fixed plus per item, e.g. "
                         f"'4+0.25*n') or 'A', got {text!r}")
    return float(m.group(1)), float(m.group(2) or 0.0)


class SimulatedDevice(torch.nn.Module):
    """Sleeps ``fixed_ms + per_item_ms * n`` per batch of ``n``; returns deterministic logits.

    The logits of image ``i`` are ``mean(x_i) * arange(num_classes)``, so equal inputs give
    equal outputs and tests can check routing. ``time.sleep`` releases the GIL: while it
    "computes", the CPUs are free for preprocessing and HTTP, as they are while a GPU works.
    """

    def __init__(self, fixed_ms: float, per_item_ms: float = 0.0, num_classes: int = 1000) -> None:
        super().__init__()
        if fixed_ms < 0 or per_item_ms < 0 or num_classes < 1:
            raise ValueError(f"need fixed_ms, per_item_ms >= 0 and num_classes >= 1, got {fixed_ms}, "
                             f"{per_item_ms}, {num_classes}")
        self.fixed_ms, self.per_item_ms, self.num_classes = fixed_ms, per_item_ms, num_classes
        self.register_buffer("classes", torch.arange(num_classes, dtype=torch.float32))

    def batch_ms(self, n: int) -> float:
        return self.fixed_ms + self.per_item_ms * n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.batch_ms(len(x)) / 1e3)
        return x.float().mean(dim=(1, 2, 3)).unsqueeze(1) * self.classes.to(x.device).unsqueeze(0)

    def extra_repr(self) -> str:
        return f"batch_ms={self.fixed_ms:g}+{self.per_item_ms:g}*n, num_classes={self.num_classes}"


def build_model(name: str, *, num_classes: int = 1000, weights: Path | None = None,
                batch_ms: str | None = None) -> torch.nn.Module:
    """``"simulated"`` (needs ``batch_ms``) or any ``torchvision.models`` classification model.

    Raises:
        ServeError: an unknown name, a missing ``batch_ms``, or weights that do not fit.
    """
    if name == "simulated":
        if batch_ms is None:
            raise ServeError("--model simulated needs --batch-ms A+B*n (the simulated device's ms per batch of n)")
        return SimulatedDevice(*parse_batch_ms(batch_ms), num_classes=num_classes)
    if batch_ms is not None:
        raise ServeError(f"--batch-ms is for --model simulated only (got --model {name})")
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        raise ServeError(f"Unknown value {name!r} for --model. Valid values are 'simulated' or a torchvision "
                         f"classification model: {', '.join(sorted(names))}.")
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if weights is not None:
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except (RuntimeError, OSError, ValueError) as exc:
            raise ServeError(f"{weights}: not a state_dict for {name} with {num_classes} classes: {exc}\n"
                             "HINT: save it with torch.save(model.state_dict(), path) and pass the same "
                             "--num-classes") from exc
    return model.eval()
