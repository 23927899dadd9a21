//! The chart's ConfigMaps are real kforge configuration: each value set in helm/kforge/ci (and the defaults) is
//! rendered with helm, and every service's `kforge.toml` is loaded through that service's own config type, which
//! rejects unknown keys and wrong types, exactly as the pod's process would load it at start.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use kforge_evaluator::EvaluatorConfig;
use kforge_gateway::GatewayConfig;
use kforge_orchestrator::OrchestratorConfig;
use kforge_profiler::ProfilerConfig;
use kforge_reward::RewardConfig;
use kforge_server::{ServiceConfig, load_section};
use kforge_test_support::python;
use serde_json::Value;

/// Tests run in parallel: each temporary file gets a name of its own.
static FILES: AtomicUsize = AtomicUsize::new(0);

fn temp_path(what: &str) -> PathBuf {
    let n = FILES.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("kforge-chart-{}-{n}-{what}", std::process::id()))
}

const SERVICES: [&str; 5] = ["gateway", "orchestrator", "reward", "evaluator", "profiler"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// helm and a Python with PyYAML (scripts/setup.sh --test installs both), or a visible skip.
fn tools() -> Option<(PathBuf, PathBuf)> {
    let helm = repo().join(".tools/bin/helm");
    if !helm.exists() {
        python::skip(format!("{} is missing: run scripts/setup.sh --test", helm.display()));
        return None;
    }
    Some((helm, python::or_skip(&["yaml"])?))
}

/// The manifests of `helm template` with `values` (none: the chart's defaults), as JSON objects.
fn render(helm: &Path, python: &Path, values: Option<&Path>) -> Vec<Value> {
    let mut helm_cmd = Command::new(helm);
    helm_cmd.args(["template", "kforge", "helm/kforge", "--namespace", "kforge"]).current_dir(repo());
    if let Some(values) = values {
        helm_cmd.arg("-f").arg(values);
    }
    let out = helm_cmd.output().expect("run helm");
    assert!(out.status.success(), "helm template {values:?}: {}", String::from_utf8_lossy(&out.stderr));
    let yaml_path = temp_path("rendered.yaml");
    std::fs::write(&yaml_path, &out.stdout).expect("write rendered chart");
    let json = Command::new(python)
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
        ])
        .arg(&yaml_path)
        .output()
        .expect("run python");
    let _ = std::fs::remove_file(&yaml_path);
    assert!(json.status.success(), "yaml to json: {}", String::from_utf8_lossy(&json.stderr));
    serde_json::from_slice(&json.stdout).expect("json manifests")
}

fn find<'a>(manifests: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    manifests.iter().find(|m| m["kind"] == kind && m["metadata"]["name"] == name)
}

/// Loads `toml` as the process would (`--config FILE`), through `T`.
fn load<T: ServiceConfig>(toml: &str, set: &str) -> T {
    let path = temp_path(&format!("{}-{set}.toml", T::SECTION));
    std::fs::write(&path, toml).expect("write config");
    let loaded = load_section::<T>(Some(&path));
    let _ = std::fs::remove_file(&path);
    loaded.unwrap_or_else(|e| panic!("{set}: [{}] does not load: {e}\n{toml}", T::SECTION))
}

fn value_sets() -> Vec<(String, Option<PathBuf>)> {
    let mut sets = vec![("defaults".to_owned(), None)];
    let mut files: Vec<_> = std::fs::read_dir(repo().join("helm/kforge/ci"))
        .expect("helm/kforge/ci")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "the CI value sets are missing: {files:?}");
    sets.extend(files.into_iter().map(|p| (p.file_stem().expect("stem").to_string_lossy().into_owned(), Some(p))));
    sets
}

#[test]
fn every_configmap_loads_through_its_service_config_type() {
    let Some((helm, python)) = tools() else { return };
    for (set, file) in value_sets() {
        let manifests = render(&helm, &python, file.as_deref());
        for service in SERVICES {
            let name = format!("kforge-{service}");
            let config = find(&manifests, "ConfigMap", &format!("{name}-config"))
                .unwrap_or_else(|| panic!("{set}: no ConfigMap for {service}"));
            let toml = config["data"]["kforge.toml"].as_str().expect("kforge.toml in the ConfigMap");
            let mut queue_capacity = None;
            let mut http_listen = None;
            let server = match service {
                "gateway" => {
                    let gateway: GatewayConfig = load(toml, &set);
                    gateway.validate().unwrap_or_else(|e| panic!("{set}: [gateway] invalid: {e}"));
                    gateway.server
                }
                "orchestrator" => {
                    let orchestrator: OrchestratorConfig = load(toml, &set);
                    let scheme = if orchestrator.server.tls.is_some() { "https:" } else { "http:" };
                    assert_eq!(
                        orchestrator.peers.evaluator,
                        "http://kforge-evaluator.kforge.svc:50051".replace("http:", scheme)
                    );
                    assert_eq!(
                        orchestrator.peers.profiler,
                        "http://kforge-profiler.kforge.svc:50052".replace("http:", scheme),
                        "{set}: cudaforge jobs call the profiler"
                    );
                    assert!(orchestrator.peers.client.auth.token_file.is_some(), "{set}: peers get the token");
                    http_listen = Some(orchestrator.http.listen.clone());
                    orchestrator.server
                }
                "reward" => load::<RewardConfig>(toml, &set).server,
                "evaluator" => {
                    let evaluator: EvaluatorConfig = load(toml, &set);
                    assert_eq!(evaluator.work_dir, Path::new("/var/lib/kforge/evaluator"));
                    queue_capacity = Some(evaluator.queue_capacity);
                    evaluator.server
                }
                "profiler" => load::<ProfilerConfig>(toml, &set).server,
                other => unreachable!("{other}"),
            };
            // The pod and its config agree: the port it listens on, the token it checks, and a grace period that
            // covers the drain (preStop pause + drain + 10 s).
            let kind = if service == "orchestrator" { "StatefulSet" } else { "Deployment" };
            let workload = find(&manifests, kind, &name).unwrap_or_else(|| panic!("{set}: no {kind} {name}"));
            // The capacity evaluator pods advertise to discovery is the queue capacity they admit.
            let annotations = &workload["spec"]["template"]["metadata"]["annotations"];
            assert_eq!(
                annotations["kforge.dev/capacity"].as_str().map(|c| c.parse::<usize>().expect("a number")),
                queue_capacity,
                "{set}: {service}'s advertised capacity"
            );
            let pod = &workload["spec"]["template"]["spec"];
            let container = &pod["containers"][0];
            assert_eq!(container["ports"][0]["containerPort"].as_u64(), Some(u64::from(server.listen.port())));
            // The orchestrator's HTTP port (orchestrator.httpPort, 8080 in every value set) is the container's
            // port `http`; no other service has one.
            let http_port = container["ports"].as_array().expect("ports").iter().find(|p| p["name"] == "http");
            assert_eq!(
                http_listen,
                http_port.map(|p| format!("0.0.0.0:{}", p["containerPort"].as_u64().expect("a port"))),
                "{set}: {service}'s [http] listen and its port `http`"
            );
            if service == "orchestrator" {
                assert_eq!(http_listen.as_deref(), Some("0.0.0.0:8080"), "{set}");
            }
            assert_eq!(server.auth.token_file.as_deref(), Some(Path::new("/var/run/kforge/token/token")));
            let pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().expect("preStop sleep");
            assert_eq!(
                pod["terminationGracePeriodSeconds"].as_u64(),
                Some(pre_stop + server.drain_timeout_secs + 10),
                "{set}: {service}'s grace period"
            );
        }
    }
}

#[test]
fn values_reach_the_typed_config() {
    let Some((helm, python)) = tools() else { return };
    let full = repo().join("helm/kforge/ci/full.yaml");
    let manifests = render(&helm, &python, Some(&full));
    let toml = |service: &str| {
        find(&manifests, "ConfigMap", &format!("kforge-{service}-config")).expect("ConfigMap")["data"]["kforge.toml"]
            .as_str()
            .expect("kforge.toml")
            .to_owned()
    };
    let gateway: GatewayConfig = load(&toml("gateway"), "full");
    assert_eq!(gateway.pools.len(), 2);
    assert_eq!(gateway.pools[0].backends[1].max_concurrency, 256);
    assert_eq!(gateway.pools[1].price.output_per_mtok, 10.0, "an integral price stays a valid float");
    assert_eq!(gateway.retry.max_attempts, 4);
    let orchestrator: OrchestratorConfig = load(&toml("orchestrator"), "full");
    assert_eq!((orchestrator.retry.attempts, orchestrator.max_in_flight.evaluator), (10, 128));
    assert_eq!(orchestrator.store, "", "with PostgreSQL the URL comes from the Secret, not the ConfigMap");
    let tls = orchestrator.server.tls.expect("TLS on");
    assert_eq!(tls.cert_file, Path::new("/var/run/kforge/tls/tls.crt"));
    assert_eq!(orchestrator.peers.client.tls_ca_file.as_deref(), Some(Path::new("/var/run/kforge/tls/ca.crt")));
    let evaluator: EvaluatorConfig = load(&toml("evaluator"), "full");
    assert_eq!(evaluator.default_policy, "kevin-strict@2");
    assert_eq!((evaluator.timing.max_seconds, evaluator.server.drain_timeout_secs), (5.5, 600));
    assert_eq!(evaluator.sandbox.command_user_base, 2_100_000_000);
}

#[test]
fn named_callers_reach_the_services_clients_call_with_their_tokens_mounted() {
    let Some((helm, python)) = tools() else { return };
    let manifests = render(&helm, &python, Some(&repo().join("helm/kforge/ci/callers.yaml")));
    let toml = |service: &str| {
        find(&manifests, "ConfigMap", &format!("kforge-{service}-config")).expect("ConfigMap")["data"]["kforge.toml"]
            .as_str()
            .expect("kforge.toml")
            .to_owned()
    };
    let orchestrator: OrchestratorConfig = load(&toml("orchestrator"), "callers");
    assert_eq!((orchestrator.quotas.jobs_in_flight, orchestrator.quotas.turns_per_hour), (2, 20_000));
    // Each named caller with its token's file, in the config of every service clients call; the mount that file
    // is read from, from the caller's Secret and key, in each of their pods.
    let secrets = [("team-a", "kforge-team-a", "token"), ("team-b", "kforge-callers", "team-b-token")];
    for service in ["gateway", "orchestrator", "evaluator", "reward"] {
        let server = match service {
            "gateway" => load::<GatewayConfig>(&toml(service), "callers").server,
            "orchestrator" => orchestrator.server.clone(),
            "evaluator" => load::<EvaluatorConfig>(&toml(service), "callers").server,
            "reward" => load::<RewardConfig>(&toml(service), "callers").server,
            other => unreachable!("{other}"),
        };
        assert_eq!(server.auth.token_file.as_deref(), Some(Path::new("/var/run/kforge/token/token")), "{service}");
        let callers: Vec<(&str, &Path)> =
            server.callers.iter().map(|c| (c.name.as_str(), c.token_file.as_deref().expect("a token file"))).collect();
        assert_eq!(
            callers,
            vec![
                ("team-a", Path::new("/var/run/kforge/callers/team-a/token")),
                ("team-b", Path::new("/var/run/kforge/callers/team-b/token"))
            ],
            "{service}"
        );
        let kind = if service == "orchestrator" { "StatefulSet" } else { "Deployment" };
        let pod =
            &find(&manifests, kind, &format!("kforge-{service}")).expect("a workload")["spec"]["template"]["spec"];
        for (caller, (name, secret, key)) in server.callers.iter().zip(secrets) {
            let dir =
                caller.token_file.as_deref().and_then(Path::parent).expect("a directory").to_str().expect("utf-8");
            let mounts = pod["containers"][0]["volumeMounts"].as_array().expect("mounts");
            let mount = mounts.iter().find(|m| m["mountPath"] == dir).unwrap_or_else(|| panic!("{service}: {dir}"));
            assert_eq!(mount["readOnly"], true);
            let volumes = pod["volumes"].as_array().expect("volumes");
            let volume = volumes.iter().find(|v| v["name"] == mount["name"]).expect("the mount's volume");
            assert_eq!(volume["secret"]["secretName"], secret, "{service}: {name}");
            assert_eq!(volume["secret"]["items"][0]["key"], key, "{service}: {name}");
            assert_eq!(volume["secret"]["items"][0]["path"], "token", "{service}: {name}");
        }
    }
    // The profiler is called by the orchestrator and the evaluator only, with the shared token.
    let profiler: ProfilerConfig = load(&toml("profiler"), "callers");
    assert!(profiler.server.callers.is_empty());
    let pod = &find(&manifests, "Deployment", "kforge-profiler").expect("profiler")["spec"]["template"]["spec"];
    assert!(
        !pod["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .any(|v| v["name"].as_str().is_some_and(|n| n.starts_with("caller-")))
    );
}

/// The orchestrator's HTTP port (orchestrator.httpPort): `[orchestrator.http] listen`, the container's and the
/// ClusterIP Service's port `http`, open in the NetworkPolicy to the gRPC port's callers; 0 renders none of them and
/// an empty `listen`, which the orchestrator reads as no HTTP port.
#[test]
fn the_orchestrator_http_port_is_rendered_and_reachable_or_off() {
    let Some((helm, python)) = tools() else { return };
    let values = temp_path("values.yaml");
    for (http_port, recipe) in [(8080, None), (9000, Some("drkernel")), (0, None)] {
        let mut yaml = format!("orchestrator:\n  httpPort: {http_port}\n");
        if let Some(recipe) = recipe {
            yaml.push_str(&format!("  config:\n    http:\n      recipe: {recipe}\n      turns: 8\n"));
        }
        std::fs::write(&values, yaml).expect("write values");
        let manifests = render(&helm, &python, Some(&values));
        let set = format!("httpPort {http_port}");
        let toml =
            find(&manifests, "ConfigMap", "kforge-orchestrator-config").expect("ConfigMap")["data"]["kforge.toml"]
                .as_str()
                .expect("kforge.toml");
        let orchestrator: OrchestratorConfig = load(toml, &set);
        let on = http_port > 0;
        let listen = if on { format!("0.0.0.0:{http_port}") } else { String::new() };
        assert_eq!(orchestrator.http.listen, listen, "{set}");
        assert_eq!(
            kforge_orchestrator::http_address(&orchestrator.http).expect("an address").is_some(),
            on,
            "{set}: the orchestrator serves HTTP"
        );
        // The rest of the table comes from the values' config.
        assert_eq!(orchestrator.http.recipe, recipe.unwrap_or("kevin"), "{set}");
        assert_eq!(orchestrator.http.turns, if recipe.is_some() { 8 } else { 4 }, "{set}");
        let named_http = |ports: &Value| -> Vec<Value> {
            ports.as_array().expect("ports").iter().filter(|p| p["name"] == "http").cloned().collect()
        };
        let pod =
            &find(&manifests, "StatefulSet", "kforge-orchestrator").expect("StatefulSet")["spec"]["template"]["spec"];
        let container = named_http(&pod["containers"][0]["ports"]);
        let service =
            named_http(&find(&manifests, "Service", "kforge-orchestrator").expect("Service")["spec"]["ports"]);
        let policy = &find(&manifests, "NetworkPolicy", "kforge-orchestrator").expect("NetworkPolicy")["spec"];
        let ingress = &policy["ingress"][0];
        let open: Vec<u64> =
            ingress["ports"].as_array().expect("ports").iter().map(|p| p["port"].as_u64().expect("a port")).collect();
        if on {
            assert_eq!(container.len(), 1, "{set}");
            assert_eq!(container[0]["containerPort"].as_u64(), Some(http_port), "{set}");
            assert_eq!(service.len(), 1, "{set}");
            assert_eq!(
                (service[0]["port"].as_u64(), &service[0]["targetPort"], &service[0]["appProtocol"]),
                (Some(http_port), &Value::from("http"), &Value::from("http")),
                "{set}"
            );
            // The same rule, so the same callers, as the gRPC port.
            assert_eq!(open, vec![50055, http_port], "{set}");
        } else {
            assert!(container.is_empty() && service.is_empty(), "{set}: no port `http`");
            assert_eq!(open, vec![50055], "{set}");
        }
        assert!(ingress["from"].as_array().is_some_and(|from| !from.is_empty()), "{set}: the clients' rule");
        // The headless Service is for the StatefulSet's names and balancing over gRPC: no HTTP port.
        let headless = find(&manifests, "Service", "kforge-orchestrator-pods").expect("headless Service");
        assert!(named_http(&headless["spec"]["ports"]).is_empty(), "{set}");
    }
    let _ = std::fs::remove_file(&values);
}

#[test]
fn values_the_chart_cannot_honour_are_refused_with_a_reason() {
    let Some((helm, _)) = tools() else { return };
    let refused = |set: &str| {
        let out = Command::new(&helm)
            .args(["template", "kforge", "helm/kforge", "--set", set])
            .current_dir(repo())
            .output()
            .expect("run helm");
        assert!(!out.status.success(), "{set} rendered");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // SQLite on a pod's volume cannot be shared by two orchestrators.
    assert!(refused("orchestrator.replicas=2").contains("needs PostgreSQL"));
    // Keys the chart owns would be silently overridden; they are errors instead.
    assert!(refused("evaluator.config.work_dir=/data").contains("evaluator.config.work_dir is set by the chart"));
    assert!(refused("reward.config.server.listen=0.0.0.0:1").contains("reward.config.server is set by the chart"));
    let http_listen = refused("orchestrator.config.http.listen=0.0.0.0:1");
    assert!(http_listen.contains("orchestrator.config.http.listen is set by the chart"), "{http_listen}");
    assert!(refused("orchestrator.httpPort=50055").contains("is the orchestrator's gRPC port"));
    // values.schema.json.
    assert!(refused("evaluator.sandbox.profile=privileged").contains("/evaluator/sandbox/profile"));
    assert!(refused("evaluator.gpu.resourceName=amd.com/gpu").contains("/evaluator/gpu/resourceName"));
    assert!(refused("orchestrator.httpPort=70000").contains("/orchestrator/httpPort"));
    // Two callers of one name could not be told apart; a name is a directory of the pod.
    let twice = "auth.callers[0].name=a,auth.callers[0].existingSecret=s,auth.callers[1].name=a,auth.callers[1].existingSecret=t";
    assert!(refused(twice).contains("auth.callers: name `a` appears twice"));
    assert!(refused("auth.callers[0].name=../x,auth.callers[0].existingSecret=s").contains("/auth/callers/0/name"));
    assert!(refused("auth.callers[0].name=a").contains("existingSecret"));
}
