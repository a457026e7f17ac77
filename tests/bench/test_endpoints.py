"""Connection reuse between the stand's client and a server: neither closes what the other is about to use."""

import httpx
import uvicorn

from specstand.bench.endpoints import KEEPALIVE_EXPIRY_S, OpenAIEndpoint
from specstand.cli import KEEP_ALIVE_S


def test_idle_connections_expire_on_the_client_before_any_uvicorn_server_closes_them():
    # uvicorn's default (vLLM keeps it) closes idle connections after 5 s; a client that may still send on
    # one at that moment gets an empty ReadError instead of an answer
    server_default = uvicorn.Config(app=None).timeout_keep_alive
    assert server_default > KEEPALIVE_EXPIRY_S
    endpoint = OpenAIEndpoint("http://127.0.0.1:1")
    assert endpoint.client._transport._pool._keepalive_expiry == KEEPALIVE_EXPIRY_S


def test_specstand_serve_keeps_idle_connections_longer_than_httpx_clients_do():
    # the openai SDK is an httpx client: with its default pool it drops an idle connection first
    assert httpx.Limits().keepalive_expiry < KEEP_ALIVE_S
