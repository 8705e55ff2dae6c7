"""The real gateway (Starlette on uvicorn, on a loopback port, in a thread of the test process) in front of
a ScriptedRun instead of a run: for tool calls and reasoning, which the demo model cannot produce. The
container is the demo model's tokenizer with GLM-5's chat template (tests/gateway/fixtures/glm5)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "glm5"


def glm5_container(tmp: Path) -> Path:
    from coli.model_store import DEMO_DIR

    d = tmp / "glm5-container"
    d.mkdir(exist_ok=True)
    shutil.copy(DEMO_DIR / "tokenizer.json", d / "tokenizer.json")
    for f in FIXTURE.iterdir():
        shutil.copy(f, d / f.name)
    return d


class ScriptedServer:
    def __init__(self, container: Path, replies: list, api_key: str | None = None, delay: float = 0.0):
        import uvicorn

        from coli.cli.serve import bind_socket
        from coli.serve.gateway import Gateway, GatewayConfig, create_app
        from coli.serve.scripted import ScriptedRun
        from coli.tokenizer import load_tokenizer

        self.tok = load_tokenizer(container)
        eos = [self.tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
        info = {"container": str(container), "model": "glm5", "max_position_embeddings": 4096,
                "vocab_size": self.tok.vocab_size, "eos_token_ids": eos}
        self.run = ScriptedRun(self.tok, info, replies, eos_id=eos[1], delay=delay)
        cfg = GatewayConfig(run_name="scripted-no-run", api_key=api_key)
        self.gateway = Gateway(cfg, None, connect=self.run.connect)
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(cfg, None, self.gateway), loop="asyncio",
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the scripted gateway did not start")
            time.sleep(0.02)

    def prompt_text(self, i: int) -> str:
        return self.tok.decode(self.run.prompts[i])

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
