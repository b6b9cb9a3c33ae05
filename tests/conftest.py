import os
import tempfile

import pytest

# One Inductor cache for the whole session, inherited by spawned ranks: identical graphs compile once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fsdp_compile_test_inductor"))


@pytest.fixture
def fake_pg():
    """A one-process fake process group of world size 2 (rank 0): traces and compiles, values are garbage."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
