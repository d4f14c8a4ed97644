"""Native code's stderr (torch's C++ warnings, faulthandler's dump) goes to a log; Python's keeps
the console (console.native_stderr_to): in a launcher, and in a rank forked inside its block."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import faulthandler, os, signal, sys
    from pathlib import Path
    from ddptrain.console import native_stderr_to, reclaim_console

    logs = Path(sys.argv[1])
    try:
        with native_stderr_to(logs / "launcher.stderr", restore_after_error=True):
            os.write(2, b"launcher: native\\n")  # a C++ warning in the launcher (its store's)
            print("launcher: python", file=sys.stderr)
            child = os.fork()  # a rank, forked as the elastic launcher forks them
            if child == 0:
                reclaim_console()
                faulthandler.enable(all_threads=True)  # as torch elastic's @record does in a rank
                with native_stderr_to(logs / "rank-0.stderr"):
                    os.write(2, b"rank: native\\n")
                    print("rank: python", file=sys.stderr, flush=True)
                    os.abort()  # gloo's abort on a collective mismatch: faulthandler's dump
            _, status = os.waitpid(child, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT
            raise RuntimeError("the launch failed")
    except RuntimeError:
        pass
    os.write(2, b"after: native\\n")  # the launcher goes on (fit() in someone's script)
    print("after: python", file=sys.stderr)
""")


def test_native_writes_go_to_the_logs_and_python_lines_to_the_console_in_the_launcher_and_its_forked_rank(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["launcher: python", "rank: python", "after: native", "after: python"]
    assert (tmp_path / "launcher.stderr").read_text() == "launcher: native\n"
    rank_log = (tmp_path / "rank-0.stderr").read_text()
    assert rank_log.startswith("rank: native\nFatal Python error: Aborted"), rank_log
