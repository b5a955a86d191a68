"""leanrl.cli and the package's lazy names: what a command does before and after its run (clean exit, the
commands that need no torch)."""

import gc
import subprocess
import sys
import textwrap

import pytest

import leanrl


def test_the_commands_that_need_no_torch_import_none():
    """`leanrl`'s names load their modules on first use: the plot and the layout planner start without torch's 3-4 s
    of imports (2-core CPU), and every exported name still resolves, to its module's object."""
    code = textwrap.dedent("""
        import sys
        import leanrl, leanrl.layout, leanrl.plot
        assert "torch" not in sys.modules, "torch imported"
        for name in leanrl.__all__:
            assert getattr(leanrl, name) is getattr(sys.modules["leanrl." + leanrl._MODULE_OF[name]], name), name
        """)
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="module 'leanrl' has no attribute 'nonexistent'"):
        leanrl.nonexistent

def test_clean_exit_keeps_the_imported_modules_out_of_the_garbage_collector_until_exit():
    """What exists on entry is frozen (full collections skip it); on the way out everything is collectable again,
    so the interpreter's teardown frees it as usual."""
    with leanrl.clean_exit():
        frozen = gc.get_freeze_count()
        created = []
        assert any(x is created for x in gc.get_objects())  # made after entry: collectable
    assert frozen > 0 and gc.get_freeze_count() == 0

def test_clean_exit_ends_a_script_without_the_interpreters_teardown(tmp_path):
    """Run as a script, a completed run ends with what Python does at exit (non-daemon threads joined, atexit
    handlers, stdout flushed) and exit code 0, but not the teardown that frees each module's objects. Under a
    wrapper with work left after the script (runpy here, as cProfile and coverage), the process goes on."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import atexit, threading, time
        import leanrl

        class Loud:
            def __del__(self):
                print("teardown", flush=True)

        freed_by_the_teardown = Loud()
        atexit.register(print, "atexit")
        with leanrl.clean_exit():
            threading.Thread(target=lambda: (time.sleep(0.2), print("thread"))).start()
            print("body")  # stdout is a pipe: buffered
        """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["body", "thread", "atexit"], run.stderr
    wrapper = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__'); print('wrapper')"
    run = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert {"body", "wrapper", "thread", "atexit", "teardown"} == set(run.stdout.split())
