"""The simulator's request: a scheduler Request with its client-side timestamps."""

from __future__ import annotations

from llmsched.core.request import Request


class SimRequest(Request):
    """A Request that also carries its client-side timestamps on the virtual clock."""

    __slots__ = ("first_token_time", "index", "last_token_time", "sent_time")

    def __init__(self, *args: object, sent_time: float = 0.0, index: int = -1, **kwargs: object) -> None:
        # The prompt list is kept, not copied: the workload builds one per
        # request, and nothing changes a prompt in place.
        super().__init__(*args, copy_prompt=False, **kwargs)
        self.sent_time = sent_time
        # Its position in the workload (-1: none), where its per-request figures go.
        self.index = index
        self.first_token_time = -1.0
        self.last_token_time = -1.0
