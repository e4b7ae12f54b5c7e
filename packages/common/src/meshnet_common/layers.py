"""The one layer-range type: half-open ``[start, end)`` over a model's decoder layers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class LayerRange:
    """Half-open range of decoder layers ``[start, end)``; ``end`` is exclusive.

    A node serving ``LayerRange(0, 10)`` of a 30-layer model holds layers 0..9 and is the
    *head*; one serving ``LayerRange(20, 30)`` is the *tail*.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or not isinstance(self.end, int):
            raise TypeError("LayerRange bounds must be integers")
        if self.start < 0 or self.end <= self.start:
            raise ValueError(
                f"invalid layer range [{self.start}, {self.end}): need 0 <= start < end"
            )

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    def is_head(self) -> bool:
        return self.start == 0

    def is_tail(self, num_layers: int) -> bool:
        return self.end == num_layers

    def check_within(self, num_layers: int) -> None:
        """Raise ValueError unless this range lies inside a model of ``num_layers`` layers."""
        if self.end > num_layers:
            raise ValueError(f"layer range {self} exceeds the model's {num_layers} layers")

    def overlaps(self, other: LayerRange) -> bool:
        return self.start < other.end and other.start < self.end

    def as_list(self) -> list[int]:
        return [self.start, self.end]
