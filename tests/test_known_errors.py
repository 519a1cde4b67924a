"""Errors whose text says what happened: a DataLoader worker's death, however it surfaced."""

from __future__ import annotations

from ddpdoctor.analysis.failed.failures import known_error

SITE = "/venv/lib/python3.11/site-packages/torch"
HANDED_OVER = f"""Traceback (most recent call last):
  File "/home/u/train.py", line 35, in main
  File "/home/u/ddpdoctor/probes/data.py", line 41, in __next__
  File "{SITE}/utils/data/dataloader.py", line 1291, in _try_get_data
  File "/usr/lib/python3.11/multiprocessing/queues.py", line 122, in get
  File "{SITE}/multiprocessing/reductions.py", line 538, in rebuild_storage_fd
  File "/usr/lib/python3.11/multiprocessing/resource_sharer.py", line 57, in detach
  File "/usr/lib/python3.11/multiprocessing/connection.py", line 395, in _recv
ConnectionResetError: [Errno 104] Connection reset by peer
"""


def test_a_worker_killed_by_a_signal_names_the_signal_and_the_loader() -> None:
    error = {"message": "DataLoader worker (pid 2771) is killed by signal: Killed. ", "traceback": ""}
    meaning, fix = known_error(error, "train.py:35") or ("", "")
    assert meaning == (
        "a DataLoader worker process of the DataLoader iterated at train.py:35 was killed by a signal "
        '(SIGKILL), "Killed", not an error in the code'
    )
    assert "num_workers" in fix and "OOM killer" in fix


def test_a_worker_that_died_while_handing_its_batch_over_is_the_same_cause() -> None:
    """The worker died as the rank fetched the tensor it shared: the connection's error inside
    torch's rebuild_storage_fd is all the rank saw."""
    error = {"message": "[Errno 104] Connection reset by peer", "traceback": HANDED_OVER}
    meaning, fix = known_error(error) or ("", "")
    assert meaning.startswith("a DataLoader worker process died while the rank took a batch from it")
    assert "ConnectionResetError" in meaning and "num_workers" in fix


def test_a_connection_reset_elsewhere_is_no_worker_death() -> None:
    elsewhere = HANDED_OVER.replace("rebuild_storage_fd", "_recv_result")
    assert known_error({"message": "[Errno 104] Connection reset by peer", "traceback": elsewhere}) is None
    no_loader = HANDED_OVER.replace("dataloader.py", "train_loop.py")
    assert known_error({"message": "x", "traceback": no_loader}) is None


def test_a_worker_that_exited_unexpectedly_without_the_signal_on_record() -> None:
    error = {"message": "DataLoader worker (pid(s) 2727, 2729) exited unexpectedly", "traceback": ""}
    meaning, fix = known_error(error, "train.py:35") or ("", "")
    assert meaning.startswith("a DataLoader worker process of the DataLoader iterated at train.py:35 exited")
    assert "num_workers" in fix
