"""A scheduling policy of your own: shortest prompt first, never preempting for waiting work.

    llmsched simulate --scheduling-policy shortest_prompt:ShortestPromptFirst \\
        --policy-config '{"max_prompt": 4096}' ...

(with this folder on PYTHONPATH). A policy is a class with the three
decisions of ``llmsched.core.policy.Policy``; ``--policy-config`` keys become
its constructor's keyword arguments.
"""

from __future__ import annotations

from llmsched.core.policies.base import KeyedQueue
from llmsched.core.policy import Refusal, Verdict
from llmsched.core.request import Request
from llmsched.core.trace import Reason


class ShortestPromptFirst:
    """Admit the shortest prompt first; refuse prompts over ``max_prompt`` tokens."""

    name = "shortest-prompt"
    # True: the scheduler asks admit() about each request it is about to admit.
    decides_admission = True

    def __init__(self, max_prompt: int = 1 << 30) -> None:
        self.max_prompt = max_prompt

    def make_queue(self) -> KeyedQueue:
        """1. Queue order: prompt length, then arrival."""
        return KeyedQueue(lambda r: r.num_prompt_tokens)

    def admit(self, request: Request, blocked: tuple[Reason, str] | None) -> Refusal | None:
        """2. Admission: decline over-long prompts; when one does not fit, stop as vLLM does."""
        if blocked is None and request.num_prompt_tokens > self.max_prompt:
            return Verdict.DECLINE, Reason.POLICY_HOLD, f"prompt over {self.max_prompt} tokens"
        return None

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """3. Victim when KV runs out: the latest admitted; never one for a waiting request."""
        return running[-1] if for_request is None else None
