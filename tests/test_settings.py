"""Settings that no process may start with: refused at start-up, with a message naming the setting."""
from __future__ import annotations

import subprocess
import sys

import pytest

from despina.settings import BadSetting, Settings


@pytest.mark.parametrize("prefix", ["", " ", "my app", "tab\there", "despina*", "a?b", "x[1]", "back\\slash",
                                    "{tag}"])
def test_a_key_prefix_that_cannot_begin_every_key_is_refused(prefix: str) -> None:
    with pytest.raises(BadSetting, match=r"DESPINA_KEY_PREFIX \(or --key-prefix\)"):
        Settings(key_prefix=prefix)


@pytest.mark.parametrize("prefix", ["despina", "team-a:prod", "svc_1.v2/blue", "ünïcode"])
def test_ordinary_key_prefixes_are_taken(prefix: str) -> None:
    assert Settings(key_prefix=prefix).key_prefix == prefix


def test_an_empty_key_prefix_on_the_command_line_stops_the_process_at_start() -> None:
    """`--key-prefix ""` made keys like ':req:model:1'; now the process says why and exits 2 before it
    touches Redis (the URL below has nothing listening)."""
    done = subprocess.run([sys.executable, "-m", "despina", "worker", "--key-prefix", "",
                           "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "despina worker: DESPINA_KEY_PREFIX (or --key-prefix) '': must not be empty" in done.stderr
