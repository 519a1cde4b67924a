"""What ddpdoctor keeps per DistributedDataParallel instance, shared by the DDP probe
(``ddp.py``: constructor, forward, backward) and the comm hook that times buckets
(``commhook.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import guard
from ddpdoctor.trace import schema

STATE = "_ddpdoctor_state"  # attribute on each DDP instance


def state_of(ddp: Any) -> ModelState | None:
    return getattr(ddp, STATE, None)


class ModelState:
    """What we keep per DDP instance: parameter names, the hook being timed, unused checks."""

    def __init__(self, ddp: Any) -> None:
        self.names = {p.data_ptr(): n for n, p in ddp.module.named_parameters()}
        self.param_names, self.params = reducer_parameters(ddp)
        self.reducer = ddp.reducer
        self.find_unused = bool(ddp.find_unused_parameters)
        self.world = ddp.process_group.size()
        self.group = ddp.process_group
        self.seq_of = seq_reader(self.group)  # the group's collective sequence number now
        self.group_named: tuple[Any, str, int] | None = None  # (group, name, size), at first use
        self.user_hook = False
        self.hook: Callable[[Any, Any], Any] | None = None  # the hook our timer calls
        self.hook_state: Any = None
        self.timer_registered = False
        self.native: Any = None  # the C++ timer's handle, when it times this model (native.py)
        # DDP's hook slot holds what we cannot or must not time: a C++ builtin hook, a hook
        # registered before we were watching, or bucket timing switched off.
        self.untimed = False
        self.timing = ""  # DDPDOCTOR_BUCKET_TIMING, read at the model's first training forward
        self.step_marks: list[int] = []  # training forwards' starts, until bucket timing is decided
        self.last_step_seen = -1
        self.layout: dict[int, int] = {}  # bucket index -> bytes, as last recorded
        self.index = 0  # this rank's n-th DistributedDataParallel: what ``unused`` records name
        self.forward_seen = False  # its first forward is watched for in-place parameter changes


def seq_reader(group: Any) -> Callable[[], int]:
    try:
        group._get_sequence_number_for_group()
        return group._get_sequence_number_for_group  # type: ignore[no-any-return]
    except Exception as exc:
        guard.passthrough(exc)
        return lambda: -1


def reducer_parameters(ddp: Any) -> tuple[list[str], list[Any]]:
    """Names and tensors in the Reducer's own order (its error messages index into it)."""
    seen: set[int] = set()
    names, params = [], []
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or name in ddp.parameters_to_ignore or id(param) in seen:
                continue
            seen.add(id(param))
            names.append(name)
            params.append(param)
    return names, params


def versions(state: ModelState) -> list[int]:
    """Each parameter's version counter, which every in-place change to it moves."""
    return [p._version for p in state.params]


def changed_in_forward(c: Any, state: ModelState, ddp: Any, before: list[int]) -> None:
    """Record the parameters the model's first forward changed in place. A forward that edits a
    weight by its own batch (``nn.Embedding(max_norm=...)`` renormalises the rows the batch
    looked up) parts the replicas without an error; the divergence finding names it as the cause
    only when the parameters that differ are among these."""
    moved = [i for i, (p, v) in enumerate(zip(state.params, before)) if p._version != v]
    if not moved:
        return
    names = [state.param_names[i] for i in moved]
    owners = {}
    for name in names:
        try:  # a name the module tree does not resolve (a tied weight's other path): no owner
            owner = ddp.module.get_submodule(name.rpartition(".")[0])
        except AttributeError:
            owners[name] = ""
            continue
        max_norm = getattr(owner, "max_norm", None)
        owners[name] = type(owner).__name__ + (f"(max_norm={max_norm})" if max_norm is not None else "")
    c.meta(schema.INPLACE, {"model": state.index, "params": names, "modules": owners})
