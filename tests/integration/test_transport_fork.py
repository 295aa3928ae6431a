"""A forked child makes a Redis transport of its own: a worker's pool process, started again
by the prefork pool after one was killed, may have been forked while another thread of the
parent held a Redis connection pool's lock; with the parent's transport every call of the
child then failed (``ChildDeadlockedError``, after five seconds each) and its task with it."""

from __future__ import annotations

import os

from shared.transport import get_transport
from shared.transport.redis import RedisTransport


def test_a_child_forked_while_the_parents_pool_is_locked_reaches_redis(
    service_env: dict[str, str],
) -> None:
    parent = get_transport()
    assert isinstance(parent, RedisTransport)
    assert parent.readiness() == {"redis": "ok"}
    held = parent._client.connection_pool._fork_lock  # as a thread of the parent holds it
    held.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: report by exit status alone, and never run pytest's exit
            code = 3
            try:
                child = get_transport()
                ready = child.readiness() == {"redis": "ok"}
                code = 0 if child is not parent and ready else 1
            finally:
                os._exit(code)
    finally:
        held.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
