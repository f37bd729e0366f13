import pickle

import pytest

from otel_forge.config import SETTINGS, ConfigError, ForgeConfig, Origin, Source


def test_defaults_when_nothing_is_set():
    config = ForgeConfig.resolve(environ={})
    assert config.sampling_interval_s == 10.0
    assert config.samples_per_window is None  # by the job's node count: see below
    assert config.prometheus_host == "localhost" and config.prometheus_port == 9464
    assert config.otlp_endpoint is None and config.otlp_protocol == "http/protobuf"
    assert config.service_name == "otel-forge"
    assert {str(source) for source in config.sources.values()} == {"default"}


@pytest.mark.parametrize(
    "nodes, samples", [(None, 1), (1, 1), (32, 1), (33, 3), (256, 3), (257, 6), (1024, 6), (1025, 12), (2048, 12)]
)
def test_the_mlflow_window_grows_with_the_job_unless_set(nodes, samples):
    assert ForgeConfig.resolve(environ={}).mlflow_samples_per_window(nodes) == samples
    # 10 s alone, 30 s and 60 s for large jobs at the default interval; a setting always wins.
    assert ForgeConfig.resolve(environ={"OTEL_FORGE_SAMPLES_PER_WINDOW": "2"}).mlflow_samples_per_window(nodes) == 2


def test_explicit_beats_env_beats_default():
    environ = {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "5", "OTEL_EXPORTER_PROMETHEUS_PORT": "9100"}
    config = ForgeConfig.resolve(environ=environ, sampling_interval_s=2)
    assert config.sampling_interval_s == 2.0 and str(config.sources["sampling_interval_s"]) == "argument"
    assert config.prometheus_port == 9100
    assert str(config.sources["prometheus_port"]) == "env OTEL_EXPORTER_PROMETHEUS_PORT"


def test_our_env_var_beats_mlflow_one():
    environ = {
        "MLFLOW_SYSTEM_METRICS_NODE_ID": "mlflow-node",
        "OTEL_FORGE_NODE_ID": "our-node",
        "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING": "4",
    }
    config = ForgeConfig.resolve(environ=environ)
    assert config.node_id == "our-node"
    assert config.samples_per_window == 4


@pytest.mark.parametrize(
    "name, raw, words",
    [
        ("sampling_interval_s", "0", "from 0.01 to 86400 s"),
        ("sampling_interval_s", "-1", "from 0.01 to 86400 s"),
        ("sampling_interval_s", "nan", "from 0.01 to 86400 s"),
        ("sampling_interval_s", "1e-9", "from 0.01 to 86400 s"),
        ("sampling_interval_s", "0.001", "from 0.01 to 86400 s"),
        ("sampling_interval_s", "1e10", "from 0.01 to 86400 s"),
        ("sampling_interval_s", "inf", "from 0.01 to 86400 s"),
        ("samples_per_window", "0", "from 1 to 10000"),
        ("collectors", " , ", "at least one of"),
        ("gpus", "x,-1", "not 'x', '-1'"),
        ("gpus", "abc", "not 'abc'"),
        ("node_id", "../../x y", "letters, digits"),
        ("node_id", ".hidden", "letters, digits"),
        ("queue_size", "99999999999", "from 1 to 100000"),
        ("spool_max_bytes", "inf", "from 0 to 1 TiB"),
        ("spool_max_bytes", "-1", "from 0 to 1 TiB"),
        ("prometheus_host", "x..y", "host name or an IP address"),
        ("call_deadline_s", "0", "from 0.1 to 3600 s"),
        ("prometheus_port", "70000", "0-65535"),
        ("collectors", "cpu,tpu", "unknown tpu"),
        ("otlp_protocol", "udp", "grpc"),
        ("otlp_endpoint", "localhost:4317", "http"),
        ("resource_attributes", "novalue", "key=value"),
        ("prometheus", "maybe", "true or false"),
    ],
)
def test_invalid_values_name_the_setting_and_the_source(name, raw, words):
    setting = next(s for s in SETTINGS if s.name == name)
    with pytest.raises(ConfigError) as from_env:
        ForgeConfig.resolve(environ={setting.env[0]: raw})
    assert f"invalid {name} (from env {setting.env[0]})" in str(from_env.value)
    assert words in str(from_env.value)
    with pytest.raises(ConfigError, match=rf"invalid {name} \(from --flag\)"):
        ForgeConfig.resolve(environ={}, argument_names={name: "--flag"}, **{name: raw})


@pytest.mark.parametrize(
    "name, words",
    [
        ("collectors", "at least one of"),
        ("mlflow_stats", "at least one of"),
        ("gpus", "'all', 'visible'"),
        ("spool_max_bytes", "size from 0"),
    ],
)
def test_an_empty_value_of_ours_is_refused(name, words):
    setting = next(s for s in SETTINGS if s.name == name)
    own_variable = next(env for env in setting.env if env.startswith("OTEL_FORGE_"))
    with pytest.raises(ConfigError, match=rf"invalid {name} \(from env {own_variable}\)") as from_env:
        ForgeConfig.resolve(environ={own_variable: ""})
    assert words in str(from_env.value)
    with pytest.raises(ConfigError, match=rf"invalid {name} \(from --flag\)") as from_flag:
        ForgeConfig.resolve(environ={}, argument_names={name: "--flag"}, **{name: ""})
    assert words in str(from_flag.value)


def test_an_empty_spec_variable_means_unset():
    # The OTel spec: an empty OTEL_* variable is unset; the next variable of the row, or the default, applies.
    config = ForgeConfig.resolve(
        environ={
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
            "OTEL_EXPORTER_PROMETHEUS_HOST": " ",
            "MLFLOW_TRACKING_URI": "",
        }
    )
    assert config.otlp_endpoint == "http://127.0.0.1:4318"
    assert str(config.sources["otlp_endpoint"]) == "env OTEL_EXPORTER_OTLP_ENDPOINT"
    assert (config.prometheus_host, str(config.sources["prometheus_host"])) == ("localhost", "default")
    assert config.tracking_uri is None


def test_an_empty_prometheus_host_flag_is_refused_rather_than_binding_every_interface():
    with pytest.raises(ConfigError, match=r"invalid prometheus_host \(from --prometheus-host\)"):
        ForgeConfig.resolve(environ={}, argument_names={"prometheus_host": "--prometheus-host"}, prometheus_host="")


def test_otlp_http_endpoint_gains_the_signal_path_only_when_generic():
    generic = ForgeConfig.resolve(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318/"})
    assert generic.otlp_metrics_url == "http://127.0.0.1:4318/v1/metrics"
    specific = ForgeConfig.resolve(environ={"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/custom"})
    assert specific.otlp_metrics_url == "http://c:4318/custom"
    grpc = ForgeConfig.resolve(
        environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert grpc.otlp_metrics_url == "http://c:4317"


@pytest.mark.parametrize(
    "given, used",
    [
        ("http://c:4318/v1/metrics", "http://c:4318/v1/metrics"),  # a full URL, as users paste it: not doubled
        ("http://c:4318/v1/metrics/", "http://c:4318/v1/metrics"),
        ("https://c/otlp/v1/metrics", "https://c/otlp/v1/metrics"),
        ("http://c:4318", "http://c:4318/v1/metrics"),  # a base URL gains the signal path
        ("http://c:4318/", "http://c:4318/v1/metrics"),
        ("https://c/otlp", "https://c/otlp/v1/metrics"),
    ],
)
def test_an_otlp_http_endpoint_argument_is_a_full_url_or_a_base_url(given, used):
    assert ForgeConfig.resolve(environ={}, otlp_endpoint=given).otlp_metrics_url == used


def test_the_otlp_endpoint_variables_keep_the_spec_meaning_whatever_the_path():
    # The signal's variable is used as is; the generic one is a base URL even if it ends in /v1/metrics.
    specific = ForgeConfig.resolve(environ={"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"})
    assert specific.otlp_metrics_url == "http://c:4318/v1/metrics"
    generic = ForgeConfig.resolve(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/v1/metrics"})
    assert generic.otlp_metrics_url == "http://c:4318/v1/metrics/v1/metrics"
    # An argument over the variables is read as an argument.
    argument = ForgeConfig.resolve(
        environ={"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/custom"}, otlp_endpoint="http://d:4318"
    )
    assert argument.otlp_metrics_url == "http://d:4318/v1/metrics"
    assert (
        ForgeConfig.resolve(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
        .replace(otlp_endpoint="http://d:4318/v1/metrics")
        .otlp_metrics_url
        == "http://d:4318/v1/metrics"
    )


def test_the_source_of_an_env_value_keeps_the_variable_through_pickling():
    config = ForgeConfig.resolve(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    source = pickle.loads(pickle.dumps(config)).sources["otlp_endpoint"]
    assert (
        source == Source(Origin.ENV, "OTEL_EXPORTER_OTLP_ENDPOINT") and str(source) == "env OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    assert source.name == "OTEL_EXPORTER_OTLP_ENDPOINT"


@pytest.mark.parametrize(
    "given, used",
    [
        ("127.0.0.1:4317", "127.0.0.1:4317"),  # scheme-less, as the OTel gRPC exporter takes it
        ("collector.example:4317", "collector.example:4317"),
        ("[::1]:4317", "[::1]:4317"),
        ("http://c:4317", "http://c:4317"),
        ("https://c:4317/", "https://c:4317"),
        ("http://c:4317/v1/metrics", "http://c:4317"),  # gRPC has no path: dropped (the agent warns)
    ],
)
def test_an_otlp_grpc_endpoint_is_host_port_or_a_url_without_path(given, used):
    config = ForgeConfig.resolve(environ={}, otlp_endpoint=given, otlp_protocol="grpc")
    assert config.otlp_metrics_url == used


@pytest.mark.parametrize(
    "environ, explicit, words",
    [
        (
            {},
            {"otlp_endpoint": "localhost:4317"},
            (
                "(from argument): must be an http:// or https:// URL with otlp_protocol "
                "http/protobuf (host:port alone is for grpc), got 'localhost:4317'"
            ),
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4318"}, {}, "(from env OTEL_EXPORTER_OTLP_ENDPOINT): must be"),
        (
            {},
            {"otlp_endpoint": "ftp://c:4317", "otlp_protocol": "grpc"},
            "(or host:port with grpc), got 'ftp://c:4317'",
        ),
        ({}, {"otlp_endpoint": "c:70000", "otlp_protocol": "grpc"}, "got 'c:70000'"),
        ({}, {"otlp_endpoint": "http://c:70000"}, "port out of range"),
        ({}, {"otlp_endpoint": "c:4317/v1/metrics", "otlp_protocol": "grpc"}, "got 'c:4317/v1/metrics'"),
    ],
)
def test_a_bad_otlp_endpoint_is_one_config_error(environ, explicit, words):
    with pytest.raises(ConfigError) as error:
        ForgeConfig.resolve(environ=environ, **explicit)
    assert str(error.value).startswith("invalid otlp_endpoint") and words in str(error.value)


def test_a_scheme_less_endpoint_stays_grpc_only_through_replace():
    grpc = ForgeConfig.resolve(environ={}, otlp_endpoint="c:4317", otlp_protocol="grpc")
    with pytest.raises(ConfigError, match="host:port alone is for grpc"):
        grpc.replace(otlp_protocol="http/protobuf")


def test_resource_attributes_follow_the_otel_format():
    config = ForgeConfig.resolve(environ={"OTEL_RESOURCE_ATTRIBUTES": "team=ml, cluster=a%2Cb"})
    assert config.resource_attributes == {"team": "ml", "cluster": "a,b"}


def test_typed_arguments_are_validated_like_text():
    config = ForgeConfig.resolve(environ={}, collectors=["cpu", "nvidia"], prometheus=False, per_cpu=True)
    assert config.collectors == ("cpu", "nvidia") and config.prometheus is False and config.per_cpu is True
    with pytest.raises(ConfigError):
        ForgeConfig.resolve(environ={}, collectors=["cpu", "gpu"])


def test_replace_validates_and_records_the_source():
    config = ForgeConfig.resolve(environ={}).replace(sampling_interval_s=0.5)
    assert config.sampling_interval_s == 0.5 and str(config.sources["sampling_interval_s"]) == "argument"
    assert config.snapshot_max_age_s == pytest.approx(0.45)
    with pytest.raises(ConfigError):
        config.replace(sampling_interval_s=0)


def test_unknown_setting_is_a_type_error():
    with pytest.raises(TypeError, match="bogus"):
        ForgeConfig.resolve(environ={}, bogus=1)


def test_the_otel_sdks_export_variables_are_honoured_in_milliseconds_below_ours():
    config = ForgeConfig.resolve(environ={"OTEL_METRIC_EXPORT_INTERVAL": "5000", "OTEL_METRIC_EXPORT_TIMEOUT": "2500"})
    assert (config.sampling_interval_s, config.export_timeout_s) == (5.0, 2.5)
    assert str(config.sources["sampling_interval_s"]) == "env OTEL_METRIC_EXPORT_INTERVAL"
    ours = ForgeConfig.resolve(
        environ={
            "OTEL_METRIC_EXPORT_INTERVAL": "5000",
            "OTEL_FORGE_SAMPLING_INTERVAL": "2",
            "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "3",
        }
    )
    assert (
        ours.sampling_interval_s == 2.0
        and str(ours.sources["sampling_interval_s"]) == "env OTEL_FORGE_SAMPLING_INTERVAL"
    )
    assert ForgeConfig.defaults().export_timeout_s == 30.0  # the SDK's default, 30000 ms


@pytest.mark.parametrize(("raw", "words"), [("abc", "'abc' milliseconds"), ("1", "from '1' milliseconds")])
def test_a_bad_otel_export_interval_says_it_was_read_as_milliseconds(raw, words):
    with pytest.raises(ConfigError) as raised:
        ForgeConfig.resolve(environ={"OTEL_METRIC_EXPORT_INTERVAL": raw})
    assert "sampling_interval_s (from env OTEL_METRIC_EXPORT_INTERVAL)" in str(raised.value) and words in str(
        raised.value
    )


def test_every_collector_the_settings_name_is_its_modules_class():
    from otel_forge.collectors import HardwareCollector, collector_class
    from otel_forge.config import COLLECTOR_NAMES

    classes = {name: collector_class(name) for name in COLLECTOR_NAMES}
    assert all(issubclass(cls, HardwareCollector) and cls.name == name for name, cls in classes.items())
