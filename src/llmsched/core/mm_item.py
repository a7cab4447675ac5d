"""One encoder input (an image) on a request: its place in the prompt and its content hash.

Its own module because the request holds these and the encoder side reads
them: both import it, neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MMItem:
    """One encoder input: where its embeddings go in the prompt and its content hash."""

    offset: int
    length: int
    identifier: str
    modality: str = "image"
    # The executor's input for the encoder (preprocessed pixels); opaque here.
    data: object = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        """First prompt position after the item."""
        return self.offset + self.length
