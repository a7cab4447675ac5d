"""The data-parallel flags shared by `llmsched simulate` and `llmsched bench throughput`."""

from __future__ import annotations

import argparse

from llmsched.engine.arg_types import positive_int
from llmsched.engine.dp.config import DPConfig, lockstep_for


def add_dp_args(parser: argparse.ArgumentParser, *, real: bool) -> argparse._ArgumentGroup:
    """Add --data-parallel-size and the balance flags (plus, for real ranks, where they meet)."""
    d = parser.add_argument_group("data parallelism")
    d.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        help="engine ranks, each with its own scheduler, KV cache and executor"
        + (
            "; a MoE model's experts are spread over all DP x TP GPUs (expert parallelism)"
            if not real
            else ""
        ),
    )
    d.add_argument(
        "--data-parallel-mode",
        choices=["auto", "lockstep", "independent"],
        default="auto",
        help="auto: MoE ranks step together (lock-step), dense ranks on their own",
    )
    d.add_argument(
        "--balance-scheduling",
        action="store_true",
        help="no rank admits new requests while any rank runs --max-num-seqs requests (lock-step only)",
    )
    d.add_argument(
        "--prefill-schedule-interval",
        type=positive_int,
        default=1,
        metavar="N",
        help="admit prefills only every N-th step while decodes run (a step counter shared by "
        "lock-stepped ranks; each engine's own otherwise)",
    )
    if real:
        d.add_argument(
            "--data-parallel-backend",
            choices=["auto", "gloo", "nccl"],
            default="auto",
            help="torch.distributed backend of the ranks' exchange (auto: nccl on CUDA, else gloo)",
        )
        d.add_argument(
            "--data-parallel-address",
            default="127.0.0.1",
            help="where ranks meet (env:// rendezvous) and reach the front end (default loopback)",
        )
        d.add_argument(
            "--data-parallel-rpc-port", type=int, default=None, help="rendezvous port (default: free)"
        )
        d.add_argument(
            "--data-parallel-size-local",
            type=int,
            default=None,
            metavar="K",
            help="start ranks 0..K-1 here and wait for the others to connect from their machines "
            "(default: all here)",
        )
        d.add_argument(
            "--data-parallel-timeout",
            type=float,
            default=300.0,
            metavar="S",
            help="a rank waiting longer than this for its peers in the exchange fails (default 300)",
        )
    return d


def dp_config_from_args(args: argparse.Namespace, is_moe: bool) -> DPConfig:
    """The DPConfig the flags describe (ConfigError names a bad combination)."""
    return DPConfig(
        data_parallel_size=args.data_parallel_size,
        lockstep=lockstep_for(is_moe, args.data_parallel_mode),
        balance_scheduling=args.balance_scheduling,
        prefill_schedule_interval=args.prefill_schedule_interval,
    )


def describe_dp(dp: DPConfig, routing: str = "least-loaded routing") -> str:
    """One line: ranks, mode, routing, policies."""
    mode = "lock-step (a rank with nothing to run steps a dummy batch)" if dp.lockstep else "independent"
    policies = []
    if dp.balance_scheduling:
        policies.append("balance scheduling")
    if dp.prefill_schedule_interval > 1:
        policies.append(f"prefills every {dp.prefill_schedule_interval} steps")
    return ", ".join([f"{dp.data_parallel_size} ranks", mode, routing, *policies])
