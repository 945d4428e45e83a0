"""tools/train.py's per-step report and configuration notes, called in this process."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import struct
import termios

import pytest
from _train.launch import CHILD_FLAG
from _train.progress import Progress
from _train.settings import launcher_settings, parser, rank_settings

#: A dropped setting that changes memory (offload itself is honoured now).
DROPPED = "zero_optimization.zero_hpz_partition_size (changes memory)"


def _steps(progress: Progress, total: int) -> None:
    for done in range(1, total + 1):
        progress.step(done, loss=4.0 - done / 10, tokens_per_s=1234.5, step_s=0.25)
    progress.close()


def test_a_redirected_log_gets_plain_lines(tmp_path):
    log = tmp_path / "train.log"
    with open(log, "w") as f, contextlib.redirect_stdout(f):
        progress = Progress(25)  # the bar is asked for, as ./dev train does by default
        assert not progress.is_bar
        _steps(progress, 25)
    text = log.read_text()
    assert "\r" not in text
    assert [line.split()[1] for line in text.splitlines()] == ["1/25", "10/25", "20/25", "25/25"]
    assert text.splitlines()[0] == "step 1/25 loss 3.9000 1,234 tok/s 0.250 s/step"


def test_a_terminal_gets_the_bar_unless_told_not_to():
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns
    with os.fdopen(follower, "w") as tty:
        progress = Progress(3, stream=tty)
        assert progress.is_bar
        _steps(progress, 3)
        tty.flush()
        drawn = b""
        while select.select([leader], [], [], 0.5)[0]:  # what the terminal got
            drawn += os.read(leader, 1 << 16)
        plain = Progress(3, stream=tty, bar=False)
        assert not plain.is_bar
    os.close(leader)
    assert b"\r" in drawn and b"3/3" in drawn and b"loss=3.700" in drawn


def test_a_resumed_run_reports_its_first_step(tmp_path):
    with open(tmp_path / "log", "w") as f:
        _steps_from = Progress(25, start=12, stream=f)
        for done in range(13, 26):
            _steps_from.step(done, 1.0, 1.0, 1.0)
    lines = (tmp_path / "log").read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["13/25", "20/25", "25/25"]


@pytest.fixture
def dropped_config(tmp_path, monkeypatch):
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", CHILD_FLAG):
        monkeypatch.delenv(key, raising=False)
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": '
        '{"stage": 3, "zero_hpz_partition_size": 8}}'
    )
    return parser().parse_args(["--deepspeed-config", str(path)])


def test_the_config_warning_is_shown_once(dropped_config, monkeypatch, capsys, caplog):
    caplog.set_level(logging.WARNING, logger="zero3.core")
    launcher_settings(dropped_config, 2)  # the launcher: its notes on stdout
    assert capsys.readouterr().out.count(DROPPED) == 1
    caplog.clear()
    monkeypatch.setenv(CHILD_FLAG, "1")  # a rank it started: not again
    monkeypatch.setenv("RANK", "0")
    rank_settings(dropped_config, 2)
    assert DROPPED not in caplog.text
    assert logging.getLogger("zero3.core").level == logging.WARNING  # caplog's, put back
    monkeypatch.delenv(CHILD_FLAG)  # rank 0 under torchrun: the only copy, so it stays
    rank_settings(dropped_config, 2)
    assert caplog.text.count(DROPPED) == 1


@pytest.mark.parametrize(
    ("sharded", "expected"),
    [
        (16, "100.0% of elements sharded (all 16 tensors)"),
        (4, "80.0% of elements sharded (4 of 16 tensors; the rest are persistent: tensors of "
            "<= 100,000 elements (param_persistence_threshold) stay whole on every rank"),
        (0, "nothing sharded: all 16 tensors are persistent: tensors of <= 100,000 elements"),
    ],
)  # fmt: skip
def test_the_summary_says_why_tensors_are_not_sharded(sharded, expected):
    from _train.report import sharded_share

    from zero3.core import Zero3Config

    psi_s = {16: 1000, 4: 800, 0: 0}[sharded]
    text = sharded_share(psi_s, 1000, sharded, 16, Zero3Config(backend="gloo"))
    assert text.startswith(expected), text
    assert ("--param-persistence-threshold 0" in text) == (sharded == 0)


def test_the_summary_says_where_a_host_stepped_offload_step_went():
    from _train.report import METRICS, _offload_line

    from zero3.core import Zero3Config

    row = dict.fromkeys(METRICS, 0.0)
    row.update(step_time=2.0, swap_walk=0.5, copy_wait=0.1, to_host=2**20, to_device=2**19)
    line = _offload_line(Zero3Config(offload_optimizer={"device": "cpu"}), [row])
    assert line.startswith("optimizer offload: cpu (stepped on the host)"), line
    assert "host-side step 0.500 s in a step of 2.000 s" in line, line
    assert "gradients to the host 1.0 MiB, stepped shards to the device 0.5 MiB" in line, line
    assert "waited 0.100 s" in line, line
    row.update(to_host=0.0, to_device=0.0)  # a CPU run: nothing moved
    line = _offload_line(Zero3Config(offload_optimizer={"device": "cpu"}), [row])
    assert line == "optimizer offload: cpu (state in host memory; no swap I/O)", line
