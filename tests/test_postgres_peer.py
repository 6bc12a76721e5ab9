"""The PostgreSQL test peer works, and has the two primitives several controllers on one store need.

Issue 22's multi-controller store leases with row locks (`FOR UPDATE SKIP LOCKED`) and wakes other
controllers with LISTEN/NOTIFY; these tests pin that Debian's server, driven by psycopg 3, gives
both, so a store test failing later is about farm's code, not the peer.
"""

from __future__ import annotations

import threading

import pytest

from tests.postgres_server import postgres_server_or_skip

psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed (pip install 'psycopg[binary]')")


@pytest.fixture(scope="module")
def peer():
    with postgres_server_or_skip() as server:
        yield server


def test_the_peer_answers_on_its_private_port_with_its_own_database(peer):
    with psycopg.connect(peer.url) as conn:
        row = conn.execute("select current_database(), current_user, inet_server_port()").fetchone()
    assert row == ("farm", "farm", peer.port)
    assert peer.url.startswith("postgresql://farm@127.0.0.1:")


def test_two_sessions_lease_disjoint_rows_with_skip_locked(peer):
    with psycopg.connect(peer.url, autocommit=True) as setup:
        setup.execute("drop table if exists tasks")
        setup.execute("create table tasks (id int primary key, state text not null)")
        setup.execute("insert into tasks select g, 'pending' from generate_series(1, 10) g")
    lease = ("select id from tasks where state = 'pending' order by id limit 3 for update skip locked")
    with psycopg.connect(peer.url) as first, psycopg.connect(peer.url) as second:
        got_first = [r[0] for r in first.execute(lease).fetchall()]  # its transaction holds the locks
        got_second = [r[0] for r in second.execute(lease).fetchall()]
        assert got_first == [1, 2, 3]
        assert got_second == [4, 5, 6], "a locked row was handed out twice"
        first.rollback()  # a controller that dies gives its rows back
        assert [r[0] for r in first.execute(lease).fetchall()] == [1, 2, 3]


def test_notify_wakes_a_listener_on_another_connection(peer):
    received: list[str] = []
    ready = threading.Event()

    def listen() -> None:
        with psycopg.connect(peer.url, autocommit=True) as conn:
            conn.execute("listen farm_work")
            ready.set()
            for note in conn.notifies(timeout=30, stop_after=1):
                received.append(note.payload)

    listener = threading.Thread(target=listen)
    listener.start()
    assert ready.wait(30)
    with psycopg.connect(peer.url, autocommit=True) as conn:
        conn.execute("select pg_notify('farm_work', 'job 7')")
    listener.join(40)
    assert received == ["job 7"]


def test_kill_takes_the_server_down_and_clients_see_it(peer):
    # Last in the module: pulling the plug is what a crash test of a store does to its database.
    conn = psycopg.connect(peer.url)
    peer.kill()
    with pytest.raises(psycopg.OperationalError):
        conn.execute("select 1")
    conn.close()
