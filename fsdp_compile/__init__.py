"""fsdp_compile: Fully Sharded Data Parallel as a torch.compile backend.

    fsdp_compile.shard(model, units=[Block], mp=fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16))
    model = torch.compile(model, backend="fsdp_compile")
"""

from fsdp_compile._agree import RanksDisagree
from fsdp_compile._backend import backend
from fsdp_compile._clip_grad_norm import clip_grad_norm_
from fsdp_compile._departure import RankFailed
from fsdp_compile._describe import ShardingSummary, describe, sync_buffers
from fsdp_compile._dump import from_environment as _dump_from_environment
from fsdp_compile._init_parameters import init_parameters
from fsdp_compile._param_groups import decay_groups
from fsdp_compile._save_safetensors import save_safetensors
from fsdp_compile._shard import set_requires_gradient_sync, shard
from fsdp_compile._step_in_backward import step_in_backward
from fsdp_compile._sharded_state_dict import load_sharded_optimizer_state_dict, sharded_optimizer_state_dict
from fsdp_compile._state_dict import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from fsdp_compile._summon import summon_full_params
from fsdp_compile._unit import full_shape, sharded_units
from fsdp_compile.config import BackendConfig, MixedPrecision
from fsdp_compile.runtime.slots import release_slabs, slab_bytes

_dump_from_environment()  # FSDP_COMPILE_DUMP=DIR: a log handler, so that the first graph's records are kept too

__all__ = [
    "BackendConfig",
    "MixedPrecision",
    "RankFailed",
    "RanksDisagree",
    "ShardingSummary",
    "backend",
    "clip_grad_norm_",
    "decay_groups",
    "describe",
    "full_optimizer_state_dict",
    "full_shape",
    "full_state_dict",
    "init_parameters",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "load_sharded_optimizer_state_dict",
    "release_slabs",
    "save_safetensors",
    "set_requires_gradient_sync",
    "shard",
    "sharded_optimizer_state_dict",
    "sharded_units",
    "slab_bytes",
    "step_in_backward",
    "summon_full_params",
    "sync_buffers",
]
