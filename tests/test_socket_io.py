"""The socket watch that replaces timing assertions sees what MLflow's client does on a thread."""

import threading


def test_a_watched_call_that_talks_to_the_server_is_counted_on_its_thread(mlflow_server, socket_io) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    with socket_io.watching():
        client.search_experiments()
    assert socket_io.operations > 0

    counted = socket_io.operations
    worker = threading.Thread(target=client.search_experiments)
    with socket_io.watching():  # the call runs on another thread: not this one's I/O
        worker.start()
        worker.join()
    assert socket_io.operations == counted
