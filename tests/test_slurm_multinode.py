"""A real 2-node Slurm (`slurm/local-cluster.sh start --nodes 2`: two slurmds on this host):
`scse-launch configs/tiny-cpu.yaml resources.nodes=2` trains at world
size 2, one rank per node, rendezvous at the first node of the job's node list; a
preemption signal reaches both nodes, the job requeues itself and resumes on both from the
checkpoint, and the evaluations it scheduled run after it."""

import json
import re

import pytest

from slurm_cluster import running_cluster
from test_slurm_e2e import logs, preempt_and_wait, scheduled, submit, wait_final

pytestmark = pytest.mark.slow
# describe_placement's line, printed by every rank at start-up
PLACEMENT = re.compile(r"^rank (\d) of (\d) \(local rank 0\) on \S+, Slurm task (\d) on node (\S+) "
                       r"\(SLURM_NODEID (\d)\), rendezvous (\S+):\d+ \(slurm\)$", re.M)


@pytest.fixture(scope="module")
def two_node_cluster():
    yield from running_cluster(nodes=2)


def test_two_node_training_preempted_requeued_resumed_then_evaluated(two_node_cluster, tmp_path):
    train = submit(tmp_path, "name=multi", "train.max_steps=40", "train.checkpoint.every=1000",
                   nodes=2)
    run_dir = tmp_path / "runs" / "multi"
    ids = scheduled(run_dir)
    assert ids["train_job"] == train
    info = preempt_and_wait(train, run_dir, tmp_path)
    out = logs(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out)
    assert (info["NumNodes"], info["NodeList"]) == ("2", "vnode[1-2]"), info

    # Both starts ran rank r as Slurm task r on node r+1, rendezvous at the first node.
    placements = sorted(PLACEMENT.findall(out))
    assert placements == [("0", "2", "0", "vnode1", "0", "vnode1")] * 2 + \
        [("1", "2", "1", "vnode2", "1", "vnode1")] * 2, out
    assert out.count("world 2 (slurm)") == 2

    # The signal reached both nodes; every rank saved step K, and the requeued job resumed there.
    saved = re.findall(r"preempted by SIGUSR1: saved step-0*(\d+) after step (\d+)", out)
    assert len(saved) == 1 and saved[0][0] == saved[0][1], out
    resumed_at = int(saved[0][0])
    assert 0 < resumed_at < 40
    assert re.findall(r"resumed \S+ at step (\d+)", out) == [str(resumed_at)]
    assert f"requeueing job {train}" in out
    steps = [json.loads(line)["step"]
             for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 40 and steps == sorted(steps) and len(set(steps)) == len(steps)
    meta = json.loads((run_dir / "checkpoints" / "step-0000040" / "scse_meta.json").read_text())
    assert meta == {"step": 40, "world_size": 2}

    # Scheduled once, on the first start; the evaluations ran after training ended.
    assert json.loads((run_dir / "eval" / "scheduled.json").read_text()) == ids
    for job in [*ids["eval_jobs"].values(), ids["report_job"]]:
        evaluated = wait_final(job)
        assert evaluated["JobState"] == "COMPLETED", evaluated
        assert evaluated["StartTime"] >= info["EndTime"]
    heldout = json.loads((run_dir / "eval" / "heldout.json").read_text())
    assert [r["depth"] for r in heldout["results"]] == [1, 2, 4]
