import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parent.parent))  # the benchmarks package (subproc takes its port helpers)


@pytest.fixture
def one_rank_group(tmp_path):
    """The default process group as one gloo rank, for a scheme's collectives (an in-process one-device Trainer
    earlier in the session may have left its world-size-1 group behind: then that one)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield
    if created:
        dist.destroy_process_group()


def meeting(control, weight_index=0, group=None):
    """A round's meeting as the fit session makes it: the control data summed over ``group`` (default: every rank)
    in its own all-reduce unless the scheme carried it."""
    import torch

    from lightning_oscars.dist.schemes import RoundMeeting

    def sum_control(values):
        summed = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(summed, group=group)
        return summed.tolist()

    return RoundMeeting(control, weight_index, sum_control)
