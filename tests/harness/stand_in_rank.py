"""A stand-in for one of vLLM's tensor-parallel workers, for node scenarios wider than 2 cores can hold real ranks:
a real Python process titled as vLLM titles its workers (``setproctitle``, ``VLLM::Worker_TP<n>``), whose main
thread waits where an idle worker waits for its next step, in a ZMQ poll inside ``worker_busy_loop`` (vLLM's
name for the worker's loop), so that py-spy reads a real stack of a real interpreter. A second thread waits on a
barrier its peers never reach, as a rank's helper thread waits in a collective.

    python stand_in_rank.py RANK SOCKET_DIR

It binds ``ipc://SOCKET_DIR/rank-RANK`` (a message there is read and dropped) and prints ``ready`` when it waits.
"""

from __future__ import annotations

import sys
import threading

import setproctitle
import zmq


def collective_wait(barrier: threading.Barrier) -> None:
    """A helper thread parked in a barrier of two, the second party never comes (like a peer that never joins)."""
    barrier.wait()


def worker_busy_loop(socket: zmq.Socket[bytes]) -> None:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while True:
        if poller.poll(timeout=1000):
            socket.recv()


def main() -> None:
    rank, socket_dir = int(sys.argv[1]), sys.argv[2]
    setproctitle.setproctitle(f"VLLM::Worker_TP{rank}")
    context = zmq.Context.instance()
    socket = context.socket(zmq.PULL)
    socket.bind(f"ipc://{socket_dir}/rank-{rank}")
    threading.Thread(target=collective_wait, args=(threading.Barrier(2),), name="collective", daemon=True).start()
    print("ready", flush=True)
    worker_busy_loop(socket)


if __name__ == "__main__":
    main()
