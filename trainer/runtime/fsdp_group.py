"""The one adapter for what an in-place regroup needs of FSDP2 beyond its public API: ``fully_shard`` taken off a
live module tree, so that it can be applied again on the next group, at the next world size.

FSDP2 has no way to move a sharded model onto another process group: its meshes hold the group, its parameters are
DTensors on those meshes, and ``fully_shard`` refuses a module it was applied to. ``release`` undoes what
``fully_shard`` did to each module (its hooks, its class, its state in the composable registry), puts a full-size
parameter on the meta device where each sharded one was (no memory: a model sharded because it does not fit on one
device never exists whole), and makes the old meshes let go of their group (its sockets close only once nothing holds
it). ``remake`` shards the same modules again, in the same order with the same mixed-precision policy, on the current
default group, allocates only this rank's shards (``to_empty``, FSDP2's way from the meta device; the buffers, never
sharded, are kept as they were) and points the optimizers at the new parameters; their values come from a checkpoint
load next (a lost rank's shard exists nowhere else). ``tests/test_recovery_fsdp.py`` pins what is used.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

_MESHES = itertools.count(1)
"""Each new group's mesh gets a name of its own. DTensor reuses an existing spec that compares equal, and meshes compare
by their ranks, not by this process's place in them: a group of the same size would get the old mesh back, with this
process's old coordinate in it (seen: two survivors claiming one shard at the next save)."""


@dataclass
class Released:
    """A model taken out of FSDP2: the modules it was applied to (bottom-up, as applied) with their policies, and the
    optimizers' parameter lists by name (their state is dropped: the checkpoint load brings it back)."""

    modules: list[tuple[nn.Module, MixedPrecisionPolicy]]
    plans: list[tuple[torch.optim.Optimizer, list[list[str]]]]
    device_type: str
    """The meshes' device type (as fully_shard's default mesh chose it)."""
    device: torch.device
    """Where the new shards go."""


def release(model: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> Released:
    """Take FSDP2 off ``model`` in place: every sharded parameter becomes a full-size one on the meta device (its
    shard goes to ``device`` at ``remake``), no hook, mesh or state of the old sharding stays, and ``optimizers`` hold
    no parameter or state of it."""
    from torch.distributed import _composable_state

    sharded: list[Any] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    swapped: dict[int, nn.Parameter] = {}
    modules: list[tuple[nn.Module, MixedPrecisionPolicy]] = []
    device_type = device.type
    for module in sharded:
        state: Any = module._get_fsdp_state()
        modules.append((module, state._mp_policy))
        for handle in {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}.values():
            handle.remove()
        for group in state._fsdp_param_groups:
            device_type = group.mesh_info.mesh.device_type
            _let_go_of_meshes(group.mesh_info, group.post_forward_mesh_info)
            for handle in [*group._module_to_pre_save_state_dict_hook_handle.values(),
                           *group._module_to_pre_load_state_dict_hook_handle.values()]:
                handle.remove()
            for param in group.fsdp_params:
                swapped[id(param.sharded_param)] = _unsharded(param)
        _composable_state._module_state_mapping.pop(module, None)
        for key in (STATE_KEY, REGISTRY_KEY):  # where the composable APIs record that they were applied
            applied = module.__dict__.get(key, {})
            for name in [n for n, v in applied.items() if v is state or getattr(n, "__name__", n) == "fully_shard"]:
                del applied[name]
        module.__class__ = module.__class__.__bases__[1]  # FSDP<Class>(FSDPModule, Class) → Class
    for module in model.modules():
        for flag in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(flag, None)
    names = {id(p): n for n, p in model.named_parameters()}
    plans = []
    for opt in optimizers:
        plans.append((opt, [[names[id(swapped[id(p)])] for p in group["params"]] for group in opt.param_groups]))
        opt.state.clear()
        for group in opt.param_groups:
            group["params"] = []
    _forget_cached_shardings()
    return Released(modules[::-1], plans, device_type, device)  # fully_shard goes bottom-up: the blocks, the root


def remake(released: Released) -> None:
    """Shard the released modules again over the current default group, and give the optimizers their new
    parameters (empty: load a checkpoint next)."""
    if not released.modules:
        return
    mesh = init_device_mesh(released.device_type, (dist.get_world_size(),), mesh_dim_names=(f"fsdp{next(_MESHES)}",))
    for module, policy in released.modules:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    root = released.modules[-1][0]
    buffers = [(m, n, b) for m in root.modules() for n, b in m._buffers.items() if b is not None]
    root.to_empty(device=released.device)  # this rank's shards only; the buffers as well, which get theirs back:
    for module, name, buffer in buffers:  # a buffer left out of state dicts (non-persistent) is in no checkpoint
        module._buffers[name] = buffer
    params = dict(root.named_parameters())
    for opt, plan in released.plans:
        for group, names in zip(opt.param_groups, plan, strict=True):
            group["params"] = [params[n] for n in names]


def _unsharded(param: Any) -> nn.Parameter:
    """A full-size parameter on the meta device in place of FSDP's ``param`` on every module that shares it."""
    old = param.sharded_param
    new = nn.Parameter(torch.empty(param._orig_size, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad)
    param._post_load_hook_handle.remove()
    info = param._module_info
    for module, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names, strict=True)]:
        module._parameters[name] = new
    return new


def _let_go_of_meshes(*infos: Any) -> None:
    """The old meshes (still referenced from DTensor's caches and any tensor the failed step left) drop their group."""
    for info in infos:
        if info is None:
            continue
        for attr in [a for a in vars(info) if a.endswith("process_group")]:
            setattr(info, attr, None)
        mesh = getattr(info, "mesh", None)
        while mesh is not None:
            mesh._pg_registry.clear()
            mesh = mesh._root_mesh


def _forget_cached_shardings() -> None:
    """DTensor caches its sharding decisions by mesh: a new mesh that equals the old one must not reuse them."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _gen_transform_infos.cache_clear()
