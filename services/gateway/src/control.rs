//! ControlBackends: one action fanned out to every backend of a pool at once, with a result per backend.
//!
//! The gateway's own state changes whatever the backend answers (a paused or sleeping backend gets no new
//! requests; requests wait for RESUME or WAKE), so routing is right even where a backend has no route for the
//! action. Where it has one, the action is sent upstream on the route of its kind:
//!
//! | action | vLLM | SGLang |
//! |---|---|---|
//! | pause / resume | `POST /pause`, `POST /resume` | `POST /pause_generation`, `POST /continue_generation` |
//! | sleep / wake | `POST /sleep?level=N`, `POST /wake_up` | `POST /release_memory_occupation`, `POST /resume_memory_occupation` |
//! | reset prefix cache | `POST /reset_prefix_cache` | `POST /flush_cache` |
//! | weight version | recorded by the gateway | `POST /update_weight_version` |
//! | weights from `model_path` | not offered (refused) | `POST /update_weights_from_disk` |
//!
//! vLLM serves sleep, wake and cache reset with `VLLM_SERVER_DEV_MODE=1`; hosted APIs and replay files have none
//! of these routes, and their results say the action was the gateway's only.

use std::sync::Arc;
use std::time::Duration;

use kforge_proto::v1 as pb;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use crate::backends::BackendClient;
use crate::config::BackendKind;
use crate::pool::{Backend, Pool};
use crate::request::InvalidField;

/// A control call may wait for a backend to load weights.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(300);

/// A validated action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Pause,
    Resume,
    Sleep { level: u32 },
    Wake,
    SetWeightVersion { version: String, model_path: Option<String> },
    ResetPrefixCache,
}

impl Action {
    /// The action of `request`, or the field that is wrong.
    pub fn from_request(request: &pb::ControlBackendsRequest) -> Result<Self, InvalidField> {
        let action = pb::ControlAction::try_from(request.action)
            .map_err(|_| InvalidField::new("action", format!("unknown action {}", request.action)))?;
        Ok(match action {
            pb::ControlAction::Unspecified => return Err(InvalidField::new("action", "must be set")),
            pb::ControlAction::Pause => Self::Pause,
            pb::ControlAction::Resume => Self::Resume,
            pb::ControlAction::Sleep => match request.sleep_level {
                0 | 1 => Self::Sleep { level: 1 },
                2 => Self::Sleep { level: 2 },
                other => return Err(InvalidField::new("sleep_level", format!("must be 1 or 2, got {other}"))),
            },
            pb::ControlAction::Wake => Self::Wake,
            pb::ControlAction::SetWeightVersion => {
                if request.weight_version.is_empty() {
                    return Err(InvalidField::new("weight_version", "must be set for SET_WEIGHT_VERSION"));
                }
                Self::SetWeightVersion {
                    version: request.weight_version.clone(),
                    model_path: (!request.model_path.is_empty()).then(|| request.model_path.clone()),
                }
            }
            pb::ControlAction::ResetPrefixCache => Self::ResetPrefixCache,
        })
    }
}

/// Applies `action` to every backend of `pool` concurrently; results in configuration order.
pub async fn fan_out(pool: &Arc<Pool>, action: Action) -> Vec<pb::ControlResult> {
    let mut tasks = JoinSet::new();
    for (index, backend) in pool.backends.iter().enumerate() {
        let backend = backend.clone();
        let action = action.clone();
        tasks.spawn(async move { (index, apply(&backend, &action).await) });
    }
    let mut results: Vec<Option<pb::ControlResult>> = vec![None; pool.backends.len()];
    while let Some(joined) = tasks.join_next().await {
        if let Ok((index, result)) = joined {
            results[index] = Some(result);
        }
    }
    pool.changed.notify_waiters();
    results
        .into_iter()
        .zip(&pool.backends)
        .map(|(result, backend)| {
            result.unwrap_or_else(|| pb::ControlResult {
                url: backend.label.clone(),
                ok: false,
                error: "the control task failed".into(),
                detail: String::new(),
            })
        })
        .collect()
}

/// An upstream call: (path, body).
type Route = (String, Option<Value>);

/// The route of `action` for a backend of `kind`; `Err` when the kind refuses it, `Ok(None)` when the action is
/// the gateway's only.
fn route(kind: BackendKind, action: &Action) -> Result<Option<Route>, String> {
    let post = |path: &str| Ok(Some((path.to_owned(), None)));
    match (kind, action) {
        (BackendKind::Vllm, Action::Pause) => post("/pause"),
        (BackendKind::Vllm, Action::Resume) => post("/resume"),
        (BackendKind::Vllm, Action::Sleep { level }) => post(&format!("/sleep?level={level}")),
        (BackendKind::Vllm, Action::Wake) => post("/wake_up"),
        (BackendKind::Vllm, Action::ResetPrefixCache) => post("/reset_prefix_cache"),
        (BackendKind::Vllm, Action::SetWeightVersion { model_path: Some(_), .. }) => {
            Err("vllm has no route that loads weights from a path; load them through the trainer, then set the \
                 version without model_path"
                .into())
        }
        (BackendKind::Vllm, Action::SetWeightVersion { model_path: None, .. }) => Ok(None),
        (BackendKind::Sglang, Action::Pause) => post("/pause_generation"),
        (BackendKind::Sglang, Action::Resume) => post("/continue_generation"),
        (BackendKind::Sglang, Action::Sleep { .. }) => Ok(Some(("/release_memory_occupation".into(), Some(json!({}))))),
        (BackendKind::Sglang, Action::Wake) => Ok(Some(("/resume_memory_occupation".into(), Some(json!({}))))),
        (BackendKind::Sglang, Action::ResetPrefixCache) => post("/flush_cache"),
        (BackendKind::Sglang, Action::SetWeightVersion { version, model_path: Some(path) }) => {
            Ok(Some(("/update_weights_from_disk".into(), Some(json!({"model_path": path, "weight_version": version})))))
        }
        (BackendKind::Sglang, Action::SetWeightVersion { version, model_path: None }) => {
            Ok(Some(("/update_weight_version".into(), Some(json!({"new_version": version})))))
        }
        (
            BackendKind::Openai | BackendKind::Llamacpp | BackendKind::Replay,
            Action::SetWeightVersion { model_path: Some(_), .. },
        ) => Err(format!("a {} backend cannot load weights", kind.name())),
        (BackendKind::Openai | BackendKind::Llamacpp | BackendKind::Replay, _) => Ok(None),
    }
}

async fn apply(backend: &Backend, action: &Action) -> pb::ControlResult {
    let mut result =
        pb::ControlResult { url: backend.label.clone(), ok: true, error: String::new(), detail: String::new() };
    // Stop routing before the backend stops serving.
    match action {
        Action::Pause => backend.set_paused(true),
        Action::Sleep { level } => backend.set_sleep_level(*level),
        Action::Resume | Action::Wake | Action::SetWeightVersion { .. } | Action::ResetPrefixCache => {}
    }
    let upstream = match route(backend.kind, action) {
        Err(refused) => {
            result.ok = false;
            result.error = refused;
            None
        }
        Ok(None) => {
            result.detail = format!("gateway only ({} backend)", backend.kind.name());
            None
        }
        Ok(Some(route)) => Some(route),
    };
    if let (Some((path, body)), BackendClient::OpenAi(client)) = (&upstream, &backend.client) {
        match client.post_control(path, body.clone(), CONTROL_TIMEOUT).await {
            Ok(status) => result.detail = format!("POST {path} -> {status}"),
            Err(error) => {
                result.ok = false;
                result.error = format!("POST {path}: {error}");
            }
        }
    }
    // Route again only once the backend serves again; record a version only once its weights are in.
    match action {
        Action::Resume => backend.set_paused(false),
        Action::Wake => backend.set_sleep_level(0),
        Action::SetWeightVersion { version, model_path } => {
            if result.ok || model_path.is_none() {
                backend.set_weight_version(version);
            }
        }
        Action::Pause | Action::Sleep { .. } | Action::ResetPrefixCache => {}
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_name_their_bad_field() {
        let request = |action: pb::ControlAction| pb::ControlBackendsRequest {
            model: "m".into(),
            action: action.into(),
            ..Default::default()
        };
        assert_eq!(Action::from_request(&request(pb::ControlAction::Unspecified)).expect_err("unset").field, "action");
        assert_eq!(
            Action::from_request(&request(pb::ControlAction::SetWeightVersion)).expect_err("no version").field,
            "weight_version"
        );
        let deep = pb::ControlBackendsRequest { sleep_level: 3, ..request(pb::ControlAction::Sleep) };
        assert_eq!(Action::from_request(&deep).expect_err("level").field, "sleep_level");
        assert_eq!(Action::from_request(&request(pb::ControlAction::Sleep)), Ok(Action::Sleep { level: 1 }));
    }

    #[test]
    fn routes_differ_by_kind() {
        let sleep = Action::Sleep { level: 2 };
        assert_eq!(route(BackendKind::Vllm, &sleep), Ok(Some(("/sleep?level=2".into(), None))));
        assert_eq!(
            route(BackendKind::Sglang, &sleep),
            Ok(Some(("/release_memory_occupation".into(), Some(json!({})))))
        );
        assert_eq!(route(BackendKind::Openai, &sleep), Ok(None));
        let load = Action::SetWeightVersion { version: "v2".into(), model_path: Some("/ckpt".into()) };
        assert!(route(BackendKind::Vllm, &load).is_err());
    }
}
