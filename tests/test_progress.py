"""progress.py: a bar redraws in place on a terminal and stays quiet in a log file."""

from __future__ import annotations

import io

from fastload.progress import LOG_INTERVAL_S, bar, is_terminal


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_file_gets_a_few_lines_not_thousands_of_updates():
    log = io.StringIO()
    assert not is_terminal(log)
    with bar(total=5000, desc="stage fast", file=log) as b:
        assert b.mininterval == LOG_INTERVAL_S >= 5
        for _ in range(5000):
            b.update()
    updates = log.getvalue().count("\r")
    assert updates <= 3, log.getvalue()[:500]  # start, (maybe) one interval, close
    assert "5000/5000" in log.getvalue()


def test_terminal_keeps_tqdm_defaults():
    tty = _Tty()
    assert is_terminal(tty)
    with bar(total=10, file=tty) as b:
        assert b.mininterval == 0.1 and b.dynamic_ncols
