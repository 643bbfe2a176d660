"""Client load on the one-node cluster's InferenceService (tests/k8s_node): streamed chat completions
in threads, every failure recorded as a lost stream.

    with Streams(served, loop=2) as load:      # 2 clients, short streams back to back until the block ends
        load.wait_done(4)                      # ... until 4 more completed (or one was lost)
    with Streams(served, once=6, long=600):    # 6 long streams, once each
    load.ok, load.errors                       # completed streams; "client i request n: <error>" per lost one
    load.error_times                           # when each was lost (time.monotonic())
    with Streams(served, loop=2, prompts=["a", "b"]) as load:   # prompts taken in turn instead of unique ones
    load.texts                                 # (prompt, max_tokens, text) of each completed stream
"""

from __future__ import annotations

import threading
import time

from harness import node_serving

LONG = 1500  # tokens of a long stream (ignore_eos): several seconds on the built-in model


class Streams:
    """Streams in threads: `loop` ones back to back until the block ends, or `once` long ones."""

    def __init__(self, served, loop: int = 0, once: int = 0, max_tokens: int = 24, long: int = LONG,
                 prompts: list[str] | None = None):
        self.served, self.max_tokens, self.long, self.prompts = served, max_tokens, long, prompts
        self.ok, self.errors, self.error_times = 0, [], []  # error_times: time.monotonic() of each lost stream
        self.texts: list[tuple[str, int, str]] = []  # (prompt, max_tokens, text) of each completed stream
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i, True), daemon=True) for i in range(loop)]
        self.threads += [threading.Thread(target=self._run, args=(i, False), daemon=True) for i in range(once)]

    def _run(self, i: int, repeat: bool) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            prompt = self.prompts[(i + n) % len(self.prompts)] if self.prompts else f"client {i} request {n}"
            max_tokens = self.max_tokens if repeat else self.long
            try:
                _, text, finish = node_serving.stream_chat(self.served.base_url, self.served.model, prompt,
                                                           max_tokens=max_tokens, timeout=300, ignore_eos=True)
                assert finish == "length", f"finish_reason {finish!r} with ignore_eos"
                with self.lock:
                    self.ok += 1
                    self.texts.append((prompt, max_tokens, text))
            except Exception as e:  # every failure is a lost stream: recorded, asserted on
                with self.lock:
                    self.errors.append(f"client {i} request {n}: {type(e).__name__}: {e}")
                    self.error_times.append(time.monotonic())
            if not repeat:
                return

    def wait_done(self, more: int, timeout: float = 120.0) -> None:
        target = self.ok + more
        deadline = time.monotonic() + timeout
        while self.ok < target and not self.errors and time.monotonic() < deadline:
            time.sleep(0.2)

    def __enter__(self) -> "Streams":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=300)
