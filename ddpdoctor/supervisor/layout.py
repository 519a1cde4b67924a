"""Where a multi-node job's store is and what shape the job has: the launcher's own arguments.

torchrun (``python -m torch.distributed.run``, the older ``torch.distributed.launch``) names the
rendezvous store and the node count on its command line or in ``PET_*`` variables; the
supervisor reads them from the command it launches, never from the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpdoctor import _env

_VALUED = {
    "nnodes",
    "node_rank",
    "nproc_per_node",
    "master_addr",
    "master_port",
    "rdzv_endpoint",
    "rdzv_backend",
    "rdzv_id",
}
_FLAGS = {"standalone", "no_python", "module", "m", "run_path", "virtual_local_rank", "use_env"}
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


@dataclass(frozen=True)
class Layout:
    """What the launcher says about the job's shape (torchrun's arguments and PET_* variables)."""

    nnodes: int = 1  # the most nodes the job may have ("1:4" -> 4)
    node_rank: int | None = None  # this node's rank, when fixed on the command line
    nproc_per_node: int | None = None
    endpoint: tuple[str, int] | None = None  # the rendezvous store

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 and self.endpoint is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "nproc_per_node": self.nproc_per_node,
            "store": f"{self.endpoint[0]}:{self.endpoint[1]}" if self.endpoint else None,
        }


def launcher_args(command: list[str]) -> list[str] | None:
    """The launcher's own options (before the training script), or None if no torchrun."""
    for i, word in enumerate(command):
        base = word.rsplit("/", 1)[-1]
        if base == "torchrun":
            return command[i + 1 :]
        if word == "-m" and i + 1 < len(command) and command[i + 1] in _LAUNCHERS:
            return command[i + 2 :]
    return None


def parse_layout(command: list[str], env: dict[str, str]) -> Layout:
    args = launcher_args(command)
    if args is None:
        return Layout()
    opts: dict[str, str] = {}
    for name in _VALUED:  # torchrun reads PET_<NAME> for any option not given
        value = env.get(f"PET_{name.upper()}")
        if value:
            opts[name] = value
    standalone = False
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("-"):
            break  # the training script: its options are its own
        name, _, value = word.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if name == "standalone":
            standalone = True
        elif name in _VALUED:
            if not value and i + 1 < len(args):
                i += 1
                value = args[i]
            opts[name] = value
        elif not value and name not in _FLAGS:
            i += 1  # an option's value we do not need
        i += 1
    nnodes = _max_nodes(opts.get("nnodes", "1"))
    if standalone:
        return Layout(1, 0, _int(opts.get("nproc_per_node")), None)
    endpoint = None
    if opts.get("rdzv_endpoint") and opts.get("rdzv_backend", "static") != "static":
        host, _, port = opts["rdzv_endpoint"].rpartition(":")
        endpoint = (host or opts["rdzv_endpoint"], _int(port) or 29400) if host else (port, 29400)
    else:
        endpoint = (opts.get("master_addr", "127.0.0.1"), _int(opts.get("master_port")) or 29500)
    override = env.get(_env.STORE, "").strip()
    if override == "off":
        endpoint = None
    elif override:
        host, _, port = override.rpartition(":")
        endpoint = (host, int(port)) if host and port.isdigit() else endpoint
    return Layout(nnodes, _int(opts.get("node_rank")), _int(opts.get("nproc_per_node")), endpoint)


def _int(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() else None


def _max_nodes(text: str) -> int:
    return max((_int(p) or 1 for p in text.split(":")), default=1)
