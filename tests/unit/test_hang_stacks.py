"""A command that runs past its time in a test comes back with every one of its processes'
stacks (helpers/sitecustomize.py, helpers.commands.finish): a hang seen once in CI says where
each process stood, forked children included."""

import subprocess
import sys

import pytest

from helpers.commands import clean_env, finish

PARENT_AND_FORKED_CHILD = """
import os, time
def parked_in_the_parent(): time.sleep(60)
def parked_in_the_child(): time.sleep(60)
if os.fork() == 0:
    parked_in_the_child()
parked_in_the_parent()
"""


@pytest.mark.slow  # 2.5 s: it waits for the timeout, then for the stacks
def test_a_command_past_its_time_comes_back_with_the_stacks_of_each_of_its_processes():
    process = subprocess.Popen([sys.executable, "-c", PARENT_AND_FORKED_CHILD], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True)
    out, err, late = finish(process, timeout=1.5)
    assert late and process.returncode == -9
    sections = err.split("--- process ")[1:]
    assert len(sections) == 2, err
    assert "in parked_in_the_parent" in sections[0] and "in parked_in_the_child" in sections[1], err
