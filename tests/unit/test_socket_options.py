"""Every Redis client carpool makes, its own and Celery's and kombu's, notices a dead peer."""

from __future__ import annotations

from types import SimpleNamespace

from carpool.celery_edge.app import create_app
from carpool.config import load_settings
from carpool.redis_edge.socket_options import MISSED_PINGS, celery_options, client_options, drop, silent


def test_carpool_clients_time_out_keep_alive_and_health_check() -> None:
    options = client_options(load_settings(redis_socket_timeout_s=3, redis_health_check_s=7))
    assert options["socket_timeout"] == options["socket_connect_timeout"] == 3
    assert options["socket_keepalive"] is True
    assert options["health_check_interval"] == 7
    assert options["retry"].get_retries() == 1


def test_the_celery_app_gives_broker_and_backend_the_same_options() -> None:
    settings = load_settings(redis_socket_timeout_s=4, redis_health_check_s=2)
    conf = create_app(settings).conf
    transport = conf.broker_transport_options
    assert transport["socket_timeout"] == transport["socket_connect_timeout"] == 4
    assert transport["health_check_interval"] == 2 and transport["socket_keepalive"] is True
    assert transport["ack_emulation"] is False  # still there beside them
    # no redis-py retry inside kombu's blocking reads, nor under .get()
    assert "retry_on_timeout" not in transport and not conf.redis_retry_on_timeout
    assert conf.redis_socket_timeout == 4 and conf.redis_backend_health_check_interval == 2
    assert celery_options(settings)["broker_transport_options"]["socket_timeout"] == 4


class _Connection:
    def __init__(self) -> None:
        self.disconnected = False

    def disconnect(self) -> None:
        self.disconnected = True


def test_a_pubsub_with_unanswered_pings_is_dropped() -> None:
    pubsub = SimpleNamespace(connection=_Connection(), health_check_response_counter=MISSED_PINGS - 1)
    assert not silent(pubsub)
    pubsub.health_check_response_counter = MISSED_PINGS
    assert silent(pubsub)
    drop(pubsub)
    assert pubsub.connection.disconnected and pubsub.health_check_response_counter == 0
    drop(None)  # no pub/sub yet: nothing to do
