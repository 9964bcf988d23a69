"""One runner subprocess and the HTTP connection pool that talks to it.

Invariants:
- A `RunnerClient` owns exactly one process. `stop()` is idempotent and always reaps it.
- A runner never outlives the supervisor: its stdin is a pipe the runner watches
  (`watch_stdin`), and on Linux the kernel sends it SIGKILL when the supervisor dies
  (PR_SET_PDEATHSIG), which covers `kill -9` of the supervisor.
- Every request carries the runner's secret, made here and written as the first line of its
  stdin (never argv: `ps` shows argv to every user).
- Every error raised here carries the last lines the runner wrote (`stderr_tail`).
- Closing a completion stream closes its HTTP connection, which cancels the request in the
  runner. `abort_streams` ends every open stream with a given error (server shutdown).
"""

from __future__ import annotations

import asyncio
import dataclasses
import collections
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import orjson

from mlxr.shared.blas import BlasChoice, choose, preload_env
from mlxr.shared.config import RunnerConfig, Settings
from mlxr.shared.errors import (InvalidModelFile, MlxrError, RunnerFailed, Unauthorized,
                                from_status, from_wire)
from mlxr.shared.exits import describe_exit
from mlxr.shared.protocol import Chunk, CompletionRequest, EmbedRequest, EmbedResponse, RunnerStatus
from mlxr.shared.runner_auth import auth_header, make_token
from mlxr.supervisor.runners.group import (Follower, GroupMixin, Host, check_remote_memory,
                                           kill_all, ring_addresses, spawn_follower)
from mlxr.supervisor.runners.spare import RUNNER_MODULE, Spare, SpareRunner

log = logging.getLogger("mlxr.runner")

STDERR_LINES = 40
STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out (bind to 0, then close): the runner binds it next."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _death_signal_preexec() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGKILL the child when its parent dies.

    libc is loaded here, in the parent: loading a library between fork and exec is unsafe."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


# Connection failures talking to a runner (a timeout included).
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class RunnerClient:
    """A started runner process, its port, and an aiohttp connection pool to it.

    aiohttp rather than httpx: every streamed token crosses this client, and aiohttp's C
    parser costs the supervisor a fraction of httpx's per-chunk work (measured with the fake
    runner: docs/PERFORMANCE.md)."""

    def __init__(self, config: RunnerConfig, process: asyncio.subprocess.Process,
                 blas: str | None = None, token: str | None = None):
        self.config = config
        self.process = process
        self.blas = blas  # the library preloaded into it, if any
        self.base_url = f"http://{config.host}:{config.port}"
        self._streams: set[CompletionStream] = set()
        self._aborting: Callable[[], MlxrError] | None = None  # set by abort_streams
        # trust_env=False: proxy variables must never route loopback traffic elsewhere.
        self.http = aiohttp.ClientSession(
            base_url=self.base_url, trust_env=False,
            headers={"Authorization": auth_header(token)} if token else None,
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=None))
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._reader = asyncio.create_task(self._read_output())
        self._stopped = False

    @classmethod
    async def spawn(cls, config: RunnerConfig, *, module: str = "mlxr.runner",
                    blas: str | None = None, env: dict[str, str] | None = None,
                    spare: Spare | None = None, **extra: Any) -> "RunnerClient":
        """Start the runner; with `config.token_stdin` it gets a fresh secret on stdin.
        `env`: the environment to start it in (default: ours, with the BLAS preload).
        `spare`: a spare runner started with `blas` (spare.py), told `config` on its stdin
        instead of starting a process."""
        if spare is None:
            process = await start_process(
                [sys.executable, "-m", module, "--config", json.dumps(config.to_dict())],
                runner_env(blas) if env is None else env)
            first = b""
        else:
            process, first = spare.process, json.dumps(config.to_dict()).encode() + b"\n"
        log.info("%s runner pid %d for %s on port %d", "started" if spare is None else
                 "gave the spare", process.pid, config.model_name, config.port)
        token = make_token() if config.token_stdin else None
        if first or token:
            assert process.stdin is not None
            process.stdin.write(first + (token.encode() + b"\n" if token else b""))
            try:
                await process.stdin.drain()
            except ConnectionError:
                pass  # it died at once: wait_ready says how
        client = cls(config, process, blas, token)
        if spare is not None:
            client._tail.extend(spare.tail)
        for key, value in extra.items():
            setattr(client, key, value)
        return client

    async def _read_output(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            log.debug("[%s] %s", self.config.model_name, line)

    # -- state -------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.returncode is None and not self._stopped

    def stderr_tail(self) -> str:
        return "\n".join(self._tail)

    async def wait_exit(self) -> int:
        code = await self.process.wait()
        try:  # the last lines arrive just after exit
            await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
        except (asyncio.TimeoutError, Exception):
            pass
        return code

    def failure(self, message: str) -> RunnerFailed:
        return RunnerFailed(message, stderr_tail=self.stderr_tail())

    def exit_failure(self, when: str) -> RunnerFailed:
        """The process is gone: how, in words ("was killed by SIGILL (illegal instruction)
        while loading"), with what that signal usually means here."""
        code = self.process.returncode
        message = f"runner for {self.config.model_name} {describe_exit(code)} {when}"
        if code == -signal.SIGILL:
            message += (f"; this CPU cannot run an instruction in MLX or in the BLAS it "
                        f"preloaded ({self.blas or 'none'}); `mlxr doctor` probes the BLAS "
                        f"libraries")
        elif code == -signal.SIGKILL:
            message += "; the system may have run out of memory"
        return self.failure(message)

    # -- lifecycle ---------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float) -> RunnerStatus:
        """Poll /v1/status until the model is loaded, the process exits, or time runs out."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        exited = asyncio.ensure_future(self.wait_exit())
        try:
            while True:
                if exited.done():
                    raise self.exit_failure("while loading")
                try:
                    status = await self.status(timeout_s=2.0)
                except (*TRANSPORT_ERRORS, ValueError, Unauthorized):
                    # A 401 is not ours (ours has our token): another process took the port
                    # between `free_port` and our runner's bind, which then fails and exits.
                    status = None
                if status is not None and status.status == "ready":
                    return status
                if status is not None and status.status == "error":
                    message = (f"runner failed to load {self.config.model_name}: "
                               f"{status.error or 'unknown error'}")
                    if status.error_kind == InvalidModelFile.kind:  # the files, not the runner
                        raise InvalidModelFile(message)
                    raise self.failure(message)
                if time.monotonic() >= deadline:
                    raise self.failure(f"timed out after {timeout_s:g}s loading "
                                       f"{self.config.model_name}")
                await asyncio.wait([exited], timeout=delay)
                delay = min(delay * 1.5, 0.1)  # a ready runner waits at most this long
        finally:
            exited.cancel()

    def abort_streams(self, make_error: Callable[[], MlxrError]) -> int:
        """End every open completion stream with `make_error()` (its connection closes, which
        cancels the request in the runner); returns how many there were."""
        self._aborting = make_error  # and any stream asked for from now on
        streams = list(self._streams)
        for stream in streams:
            stream.abort(make_error())
        return len(streams)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Close stdin and send SIGTERM, then SIGKILL after `grace_s`; always reaps."""
        self._stopped = True
        await self.http.close()
        proc = self.process
        if proc.returncode is None:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()
            try:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), grace_s)
            except ProcessLookupError:
                pass
            except asyncio.TimeoutError:
                log.warning("runner pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
        await proc.wait()
        self._reader.cancel()

    # -- requests ----------------------------------------------------------------------

    async def status(self, timeout_s: float = 5.0) -> RunnerStatus:
        async with self.http.get("/v1/status",
                                 timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            content = await resp.read()
        if resp.status != 200:
            raise _http_error(resp.status, content)
        return RunnerStatus.from_dict(orjson.loads(content))

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        return EmbedResponse.from_dict(await self._post_json("/v1/embeddings", request.to_dict()))

    async def tokenize(self, text: str, add_special: bool) -> list[int]:
        """The model's token ids for `text` (the runner's /v1/tokenize)."""
        reply = await self._post_json("/v1/tokenize", {"content": text,
                                                       "add_special": add_special})
        return list(reply["tokens"])

    async def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.http.post(path, data=orjson.dumps(body),
                                      headers={"content-type": "application/json"}) as resp:
                content = await resp.read()
        except TRANSPORT_ERRORS as exc:
            raise await self._lost(exc) from None
        if resp.status != 200:
            raise _http_error(resp.status, content)
        return orjson.loads(content)

    async def complete(self, request: CompletionRequest) -> "CompletionStream":
        """Send a completion. Errors found before streaming (bad input, context overflow)
        raise here with the runner's status; the returned stream yields `Chunk`s."""
        if self._aborting is not None:
            raise self._aborting()
        try:
            resp = await self.http.post("/v1/completions", data=orjson.dumps(request.to_dict()),
                                        headers={"content-type": "application/json"})
        except TRANSPORT_ERRORS as exc:
            raise await self._lost(exc) from None
        if resp.status != 200:
            try:
                body = await resp.read()
            except TRANSPORT_ERRORS as exc:
                raise await self._lost(exc) from None
            finally:
                resp.release()
            raise _http_error(resp.status, body)
        return CompletionStream(self, resp)

    async def _lost(self, exc: BaseException) -> MlxrError:
        """The connection broke: say whether the runner died, with its last words."""
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), 1.0)
        except asyncio.TimeoutError:
            pass
        if self.process.returncode is not None:
            await asyncio.sleep(0.05)  # let the reader collect the last lines
            return self.exit_failure("while serving")
        return RunnerFailed(f"lost connection to runner for {self.config.model_name}: "
                            f"{exc or type(exc).__name__}")


class CompletionStream:
    """The chunks of one accepted completion; the final chunk has `done: true`."""

    def __init__(self, client: RunnerClient, response: aiohttp.ClientResponse):
        self._client = client
        self._response = response
        self._aborted: MlxrError | None = None
        client._streams.add(self)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        pending = b""
        try:
            async for data in self._response.content.iter_any():
                if self._aborted is not None:
                    break
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    chunk = _chunk(orjson.loads(line))
                    yield chunk
                    if chunk.done:
                        return
        except TRANSPORT_ERRORS as exc:
            if self._aborted is None:
                raise await self._client._lost(exc) from None
        except orjson.JSONDecodeError as exc:
            raise RunnerFailed(f"runner sent an invalid line: {exc}") from None
        finally:
            self._client._streams.discard(self)
        if self._aborted is not None:
            raise self._aborted
        raise await self._client._lost(ConnectionError("stream ended without a final line"))

    def abort(self, error: MlxrError) -> None:
        """End the stream: the reader raises `error` instead of its next chunk."""
        if self._aborted is None:
            self._aborted = error
            self._response.close()

    async def aclose(self) -> None:
        """Close the connection (not back to the pool), which cancels an unfinished request
        in the runner."""
        self._client._streams.discard(self)
        self._response.close()


def _chunk(data: dict[str, Any]) -> Chunk:
    """A stream line; an error line (shared.protocol.error_line) raises the class it names."""
    if "error" in data:
        err = data["error"]
        if isinstance(err, dict):
            status = err.get("status")
            status = status if isinstance(status, int) and 400 <= status < 600 else 500
            raise from_wire(status, str(err.get("message")), err.get("kind"))
        raise RunnerFailed(str(err))
    return Chunk.from_dict(data)


def _http_error(status: int, body: bytes) -> MlxrError:
    """The error a runner answered with an HTTP status (shared.protocol.error_body): the class
    its `kind` names; a body with no kind (aiohttp's own replies, an older runner) goes by
    the status."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return from_status(status, body.decode(errors="replace").strip() or "runner error")
    err = data.get("error")
    message = str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return from_wire(status, message, data.get("kind"))


class BlasSelection:
    """The BLAS runners preload, chosen once per supervisor in a worker thread: a first
    probe of the candidates takes seconds, a cached verdict milliseconds."""

    def __init__(self, settings: Settings):
        self._settings = settings
        self._task: asyncio.Task[BlasChoice] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._choose())

    async def choice(self) -> BlasChoice:
        self.start()
        assert self._task is not None
        return await asyncio.shield(self._task)

    async def _choose(self) -> BlasChoice:
        choice = await asyncio.to_thread(choose, self._settings.blas, self._settings.cache_dir)
        log.info("%s", choice.describe())
        return choice


async def start_process(argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    """A runner process: stdin a pipe it watches, stdout and stderr one pipe we read."""
    return await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=env, preexec_fn=_death_signal_preexec(),
        # Its own session: a Ctrl-C in the terminal reaches the supervisor only, which then
        # stops its runners in order.
        start_new_session=True)


async def start_spare(blas: str | None) -> asyncio.subprocess.Process:
    """A spare runner (spare.py) with `blas` preloaded."""
    return await start_process([sys.executable, "-m", RUNNER_MODULE, "--spare"],
                               runner_env(blas))


def runner_env(blas: str | None) -> dict[str, str]:
    """A runner inherits our environment (PATH, PYTHONPATH, HF_* ...); only the BLAS preload
    is added (a library that passed its probe on this CPU, shared/blas.py), which makes
    float32 matmuls several times faster on Linux CPU, with its threads' spin timeout."""
    env = dict(os.environ)
    return preload_env(env, blas) if blas else env


class RunnerGroup(GroupMixin, RunnerClient):
    """Rank 0 of a distributed runner and its followers (group.py)."""

    @classmethod
    async def spawn_group(cls, config: RunnerConfig, hosts: list[Host], *, module: str,
                          blas: str | None, remote_shell: str = "ssh") -> "RunnerGroup":
        config = dataclasses.replace(config, rank=0, ring=ring_addresses(hosts))
        env = runner_env(blas)
        followers: list[Follower] = []
        try:
            for rank in range(1, len(hosts)):
                followers.append(await spawn_follower(rank, hosts[rank], config, module, env,
                                                      _death_signal_preexec(), remote_shell))
            return await cls.spawn(config, module=module, blas=blas, env=env,
                                   followers=followers, hosts=hosts)
        except BaseException:
            kill_all(followers)
            raise


PORT_ATTEMPTS = 3  # `free_port` hands out a port another process may bind first


async def _ready(client: RunnerClient, timeout_s: float) -> RunnerClient:
    try:
        await client.wait_ready(timeout_s)
    except BaseException:
        await asyncio.shield(client.stop(grace_s=1.0))
        raise
    return client


def _port_taken(client: RunnerClient) -> bool:
    """Did the (stopped) runner fail because its port was in use (EADDRINUSE: the HTTP
    server's words, or MLX's ring backend's for one of a group's ring ports)?"""
    tail = client.stderr_tail().lower()
    return "address already in use" in tail or "couldn't bind socket (error: 98)" in tail


def make_runner_factory(settings: Settings, blas: BlasSelection | None = None,
                        spares: SpareRunner | None = None,
                        ) -> Callable[[Any], Awaitable[RunnerClient]]:
    """The production factory: spawn `python -m mlxr.runner` (or take `spares`' spare) for a
    LoadSpec and wait until ready."""
    blas = blas or BlasSelection(settings)

    async def start(spec: Any) -> RunnerClient:
        library = (await blas.choice()).path
        try:
            return await _start(spec, library)
        finally:
            if spares is not None:  # the next load's, made once this one is done
                spares.replenish(library)

    async def _start(spec: Any, library: str | None) -> RunnerClient:
        config = RunnerConfig(
            model_dir=str(spec.model_dir), model_name=spec.name, host="127.0.0.1",
            port=free_port(), num_parallel=settings.num_parallel,
            context_length=spec.context_length, prefix_cache_bytes=settings.prefix_cache_bytes,
            kv_cache_bytes=spec.kv_cache_bytes // spec.local_ranks,
            kv_layout=settings.kv_layout, host_attention=settings.host_attention,
            attention_buckets=settings.attention_buckets,
            float32_weights=settings.float32_weights, watch_stdin=True, token_stdin=True,
            blas=library or "off", sharding=spec.sharding,
            probe_cache_dir=str(settings.cache_dir / "probes"))
        if spec.hosts:  # one runner made of the hostfile's ranks
            await check_remote_memory(spec, settings.remote_shell)

            async def spawn(config: RunnerConfig) -> RunnerClient:
                # (each start draws the ring's ports afresh: spawn_group's ring_addresses)
                return await RunnerGroup.spawn_group(
                    config, list(spec.hosts), module=settings.runner_module, blas=library,
                    remote_shell=settings.remote_shell)
        else:
            spare = iter([spares.take(library)] if spares is not None else [])

            async def spawn(config: RunnerConfig) -> RunnerClient:
                return await RunnerClient.spawn(config, module=settings.runner_module,
                                                blas=library, spare=next(spare, None))
        attempts = 1
        while True:
            client = await spawn(config)
            try:
                return await _ready(client, settings.load_timeout_s)
            except RunnerFailed:
                if attempts == PORT_ATTEMPTS or not _port_taken(client):
                    raise
            log.info("a port of %s (%d, or its ranks') was taken before it was bound; trying "
                     "others", spec.name, config.port)
            config = dataclasses.replace(config, port=free_port())
            attempts += 1

    return start
