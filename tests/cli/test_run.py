"""`plainformer.cli.run`, the command's exit: main's status, atexit's functions and the flushed streams,
without the interpreter's teardown (an object's __del__ at shutdown is the teardown's mark)."""

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

# A child with an atexit function and an object whose __del__ only the interpreter's teardown would call.
PRELUDE = textwrap.dedent("""
    import atexit, io, sys, threading, time

    class TornDown:
        # stderr bound now: the teardown may have set this module's `sys` to None by the time it frees `kept`
        # (it does when dill, which lm-eval brings, is imported with torch)
        def __del__(self, stderr=sys.stderr):
            print("torn down", file=stderr)

    class Unflushable(io.StringIO):
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    kept = TornDown()
    atexit.register(lambda: print("atexit ran", file=sys.stderr))
""")

# ... whose `main` writes its product with no newline (only a flush puts it on a pipe) and returns STATUS.
COMMAND = textwrap.dedent("""
    import plainformer.cli as cli

    def main():
        sys.stdout.write("the product")
        {setup}
        return {status}

    cli.main = main
    cli.run()
""")


def run_child(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def run_command(status: int, setup: str = "pass", **env: str) -> subprocess.CompletedProcess:
    return run_child(COMMAND.format(status=status, setup=setup), **env)


def test_the_command_exits_with_mains_status_after_atexit_and_a_flush_without_the_teardown():
    child = run_command(3)
    assert (child.returncode, child.stdout) == (3, "the product")
    assert "atexit ran" in child.stderr
    assert "torn down" not in child.stderr


def test_a_thread_that_is_not_a_daemon_finishes_in_pythons_own_exit():
    child = run_command(0, setup="threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()")
    assert (child.returncode, child.stdout) == (0, "the productthread done\n")
    assert "atexit ran" in child.stderr and "torn down" in child.stderr


def test_a_torchrun_rank_takes_pythons_exit():
    child = run_command(2, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    assert (child.returncode, child.stdout) == (2, "the product")
    assert "atexit ran" in child.stderr and "torn down" in child.stderr


def test_a_stream_that_cannot_be_flushed_takes_pythons_exit_which_reports_it():
    child = run_command(0, setup="sys.stdout = Unflushable()")
    assert child.returncode == 120  # Python's status for a standard stream it could not flush
    assert "atexit ran" in child.stderr and "torn down" in child.stderr


def test_python_dash_m_plainformer_runs_the_command_and_so_does_the_console_script():
    child = run_child("import runpy\nrunpy.run_module('plainformer', run_name='__main__')")
    assert child.returncode == 2 and "usage: plainformer" in child.stderr  # no command: the help, status 2
    assert "atexit ran" in child.stderr and "torn down" not in child.stderr
    (script,) = entry_points(group="console_scripts", name="plainformer")
    assert script.value == "plainformer.cli:run"
