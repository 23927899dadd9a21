//! KernelGym's evaluation server (hkust-nlp/KernelGYM, Dr. Kernel's reward service) over kforge's evaluator pool,
//! nested at `/kernelgym`: its client's `server_url` is `http://host:port/kernelgym` (docs/faces/KERNELGYM.md).
//!
//! `POST /evaluate` blocks until the evaluation ends, as upstream; the task is `processing` meanwhile, so a client
//! polling `/status/{task_id}` (as upstream's does) sees it, then `completed` or `failed`, and reads the result from
//! `/results/{task_id}`. A kernel that does not compile, is wrong or crashes is `completed` with `compiled` or
//! `correctness` false and the reason in `error_message` (in `/status` too); a hack is `decoy_kernel`; `failed` is
//! the evaluator's failure. Results are kept in memory, bounded by `orchestrator.http.kernelgym_results`.

mod table;
mod wire;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use http::{HeaderValue, StatusCode};
use kforge_server::json::{JsonError, connect_code};
use serde_json::{Value, json};
use tokio::sync::watch;
use tonic::Code;

use super::{Faces, parse};
use table::{Found, Outcome, Rejection, Table, View};
use wire::{BatchRequest, Checked, EvaluationRequest, EvaluationResponse, iso};

/// The largest request body: a batch of upstream's 100 tasks with two sources of up to 100,000 characters each.
const BODY_BYTES: usize = 32 << 20;
/// Most tasks in a batch, as upstream.
const BATCH_TASKS: usize = 100;

#[derive(Debug)]
struct KernelGym {
    faces: Faces,
    table: Mutex<Table>,
    started: Instant,
}

pub(super) fn router(faces: Faces) -> axum::Router {
    let capacity = faces.config().kernelgym_results;
    let face = Arc::new(KernelGym { faces, table: Mutex::new(Table::new(capacity)), started: Instant::now() });
    axum::Router::new()
        .route("/", get(root))
        .route("/health", get(health))
        .route("/evaluate", post(evaluate))
        .route("/evaluate/batch", post(batch))
        .route("/status/{task_id}", get(status))
        .route("/results/{task_id}", get(results))
        .route("/tasks/{task_id}", delete(cancel))
        .layer(DefaultBodyLimit::max(BODY_BYTES))
        .with_state(face)
}

impl KernelGym {
    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock leaves the table consistent (each method is one step): keep serving.
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The result of `checked`: the stored one (unless `force_refresh`), the one in flight, or a new evaluation.
    /// The evaluation runs in a task of its own, so a client that disconnects loses nothing: the result is stored.
    async fn submit(self: &Arc<Self>, checked: Checked, submitted: SystemTime) -> Outcome {
        let mut receiver = {
            let mut table = self.table();
            match table.find(&checked.task_id) {
                Some(Found::Finished(result)) if !checked.force_refresh => return Ok(result),
                Some(Found::InFlight(receiver)) if !checked.force_refresh => receiver,
                _ => {
                    let done = Arc::new(watch::channel(None).0);
                    let receiver = done.subscribe();
                    let generation = table.begin(&checked.task_id, submitted, done.clone());
                    let task_id = checked.task_id.clone();
                    let face = self.clone();
                    let running = tokio::spawn(async move { face.run(checked, submitted, generation, done).await });
                    table.set_abort(&task_id, generation, running.abort_handle());
                    receiver
                }
            }
        };
        match receiver.wait_for(Option::is_some).await {
            Ok(outcome) => outcome.clone().expect("waited for an outcome"),
            // Every sender gone without an answer (not expected: the evaluation's guard answers).
            Err(_) => Err(Rejection::Busy(JsonError::new(Code::Internal, "the evaluation was lost", None))),
        }
    }

    async fn run(self: Arc<Self>, checked: Checked, submitted: SystemTime, generation: u64, done: table::Done) {
        let task_id = checked.task_id.clone();
        let guard = Unanswered { face: self.clone(), task_id: task_id.clone(), generation, done: done.clone() };
        let outcome = match self.faces.evaluate(checked.evaluation.clone()).await {
            Ok(response) => Ok(Arc::new(wire::result(&checked, &response).stamped(submitted, SystemTime::now()))),
            Err(error) => match error.code() {
                Code::ResourceExhausted | Code::Unavailable => Err(Rejection::Busy(error)),
                Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                    Err(Rejection::Invalid(upstream_field(&error)))
                }
                code => {
                    let message = format!("{}: {}", connect_code(code), error.message());
                    let failed = EvaluationResponse::bare(&task_id, "failed", Some("SYSTEM_ERROR"), message);
                    Ok(Arc::new(failed.stamped(submitted, SystemTime::now())))
                }
            },
        };
        {
            let mut table = self.table();
            match &outcome {
                Ok(result) => table.finish(&task_id, generation, result.clone()),
                Err(_) => table.forget(&task_id, generation),
            }
        }
        // Stored first: once `/evaluate` answers, `/status` says so too. A cancel may have answered already.
        answer_once(&done, outcome);
        drop(guard);
    }
}

/// Sends `outcome` unless an outcome was sent already (a cancel's).
fn answer_once(done: &table::Done, outcome: Outcome) {
    done.send_if_modified(|held| {
        let empty = held.is_none();
        if empty {
            *held = Some(outcome);
        }
        empty
    });
}

/// An evaluation that ends without an answer (its task panicked) still answers its waiters, and is forgotten.
#[derive(Debug)]
struct Unanswered {
    face: Arc<KernelGym>,
    task_id: String,
    generation: u64,
    done: table::Done,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.done.borrow().is_some() {
            return;
        }
        self.face.table().forget(&self.task_id, self.generation);
        let lost = JsonError::new(Code::Internal, "the evaluation ended without a result", None);
        answer_once(&self.done, Err(Rejection::Busy(lost)));
    }
}

/// The evaluator's field as the KernelGym request names it (`task.source` is `reference_code`).
fn upstream_field(error: &JsonError) -> JsonError {
    let Some(field) = error.field() else { return error.clone() };
    let renamed = match field.split_once('.').map_or(field, |(head, _)| head) {
        "task" if field.starts_with("task.source") => "reference_code",
        "task" => "task_id",
        "candidate_source" => "kernel_code",
        "correctness_trials" => "num_correct_trials",
        "backend" => "backend",
        _ => return error.clone(),
    };
    let detail = error.message().strip_prefix(field).and_then(|m| m.strip_prefix(": ")).unwrap_or(error.message());
    JsonError::new(error.code(), format!("{renamed}: {detail}"), Some(renamed))
}

/// Upstream's validation answer (`error`, `message`, `error_code`, `task_id`, `timestamp`; 400 with `X-Error-Code`)
/// with kforge's `code` and `field` beside them.
fn validation(task_id: Option<&str>, error: &JsonError) -> Response {
    let mut body = error.body();
    body["error"] = "RequestValidationError".into();
    body["message"] = format!("Request validation failed: {}", error.message()).into();
    body["error_code"] = "VALIDATION_ERROR".into();
    body["task_id"] = task_id.map_or(Value::Null, Value::from);
    body["timestamp"] = iso(SystemTime::now()).into();
    let mut response = (StatusCode::BAD_REQUEST, Json(body)).into_response();
    response.headers_mut().insert("x-error-code", HeaderValue::from_static("VALIDATION_ERROR"));
    response
}

fn not_found(task_id: &str) -> Response {
    let message = format!("Task {task_id} not found");
    let mut body = JsonError::new(Code::NotFound, format!("task_id: {message}"), Some("task_id")).body();
    body["detail"] = message.into();
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

fn answer(task_id: &str, outcome: Outcome) -> Response {
    match outcome {
        Ok(result) => Json(&*result).into_response(),
        Err(Rejection::Busy(error)) => error.into_response(),
        Err(Rejection::Invalid(error)) => validation(Some(task_id), &error),
    }
}

/// The task id of a body that did not parse, for the error's `task_id`.
fn task_id_of(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    value.get("task_id")?.as_str().map(str::to_owned)
}

async fn evaluate(State(face): State<Arc<KernelGym>>, body: Bytes) -> Response {
    let submitted = SystemTime::now();
    let request: EvaluationRequest = match parse(&body) {
        Ok(request) => request,
        Err(error) => return validation(task_id_of(&body).as_deref(), &error),
    };
    let checked = match wire::check(&request, "") {
        Ok(checked) => checked,
        Err(error) => return validation(Some(&request.task_id), &error),
    };
    let task_id = checked.task_id.clone();
    answer(&task_id, face.submit(checked, submitted).await)
}

/// Upstream runs a batch's tasks one after another; here they run together (the evaluator pool schedules them),
/// each stored under its task id as `/evaluate` stores it.
async fn batch(State(face): State<Arc<KernelGym>>, body: Bytes) -> Response {
    let submitted = SystemTime::now();
    let request: BatchRequest = match parse(&body) {
        Ok(request) => request,
        Err(error) => return validation(None, &error),
    };
    if request.tasks.is_empty() || request.tasks.len() > BATCH_TASKS {
        let message = format!("tasks: {} tasks; 1 to {BATCH_TASKS} are accepted", request.tasks.len());
        return validation(None, &JsonError::new(Code::InvalidArgument, message, Some("tasks")));
    }
    let mut checked = Vec::with_capacity(request.tasks.len());
    for (i, task) in request.tasks.iter().enumerate() {
        match wire::check(task, &format!("tasks[{i}].")) {
            Ok(task) => checked.push(task),
            Err(error) => return validation(Some(&task.task_id), &error),
        }
    }
    let mut running = tokio::task::JoinSet::new();
    for (i, task) in checked.into_iter().enumerate() {
        let face = face.clone();
        running.spawn(async move {
            let task_id = task.task_id.clone();
            (i, task_id, face.submit(task, submitted).await)
        });
    }
    let mut results: Vec<Option<Arc<EvaluationResponse>>> = vec![None; request.tasks.len()];
    while let Some(joined) = running.join_next().await {
        let Ok((i, task_id, outcome)) = joined else { continue };
        let result = outcome.unwrap_or_else(|rejection| {
            let (code, error) = match rejection {
                Rejection::Busy(error) => ("RESOURCE_ERROR", error),
                Rejection::Invalid(error) => ("VALIDATION_ERROR", error),
            };
            let failed = EvaluationResponse::bare(&task_id, "failed", Some(code), error.message().to_owned());
            Arc::new(failed.stamped(submitted, SystemTime::now()))
        });
        results[i] = Some(result);
    }
    let results: Vec<Arc<EvaluationResponse>> = results
        .into_iter()
        .zip(&request.tasks)
        .map(|(result, task)| {
            result.unwrap_or_else(|| {
                let message = "the evaluation's task ended without a result".to_owned();
                Arc::new(EvaluationResponse::bare(&task.task_id, "failed", Some("SYSTEM_ERROR"), message))
            })
        })
        .collect();
    let failed = results.iter().filter(|r| r.failed()).count();
    Json(json!({
        "batch_id": request.batch_id,
        "total_tasks": results.len(),
        "completed_tasks": results.len() - failed,
        "failed_tasks": failed,
        "results": results.iter().map(|r| &**r).collect::<Vec<_>>(),
        "batch_status": "completed",
        "submitted_at": iso(submitted),
        "completed_at": iso(SystemTime::now()),
    }))
    .into_response()
}

/// Upstream's `TaskStatusResponse`, plus what its model strips: the submission and completion times and, for a
/// finished task, `error_message` and `error_code` (a compile error reaches a client that reads only `/status`).
async fn status(State(face): State<Arc<KernelGym>>, Path(task_id): Path<String>) -> Response {
    let view = face.table().view(&task_id);
    let mut body = json!({
        "task_id": task_id, "progress": null, "estimated_completion": null, "queue_position": null,
        "assigned_device": null,
    });
    match view {
        None => return not_found(&task_id),
        Some(View::Processing { submitted }) => {
            body["status"] = "processing".into();
            body["submitted_at"] = iso(submitted).into();
        }
        Some(View::Finished(result)) => {
            body["status"] = result.status.clone().into();
            body["submitted_at"] = json!(result.submitted_at);
            body["completed_at"] = json!(result.completed_at);
            body["error_message"] = json!(result.error_message);
            body["error_code"] = json!(result.error_code);
        }
    }
    Json(body).into_response()
}

/// The stored `EvaluationResponse`; while the evaluation runs, one with `status: processing` and nothing else.
async fn results(State(face): State<Arc<KernelGym>>, Path(task_id): Path<String>) -> Response {
    let view = face.table().view(&task_id);
    match view {
        None => not_found(&task_id),
        Some(View::Finished(result)) => Json(&*result).into_response(),
        Some(View::Processing { submitted }) => {
            let mut pending = EvaluationResponse::bare(&task_id, "processing", None, String::new());
            pending.error_message = None;
            pending.submitted_at = Some(iso(submitted));
            Json(pending).into_response()
        }
    }
}

async fn cancel(State(face): State<Arc<KernelGym>>, Path(task_id): Path<String>) -> Response {
    let cancelled = face.table().cancel(&task_id, SystemTime::now());
    match cancelled {
        None => not_found(&task_id),
        Some(true) => Json(json!({"message": format!("Task {task_id} cancelled successfully")})).into_response(),
        Some(false) => Json(json!({"message": format!("Task {task_id} forgotten (it had finished)")})).into_response(),
    }
}

/// Upstream's `SystemHealthResponse`: `status` is what its client checks (`healthy`).
async fn health(State(face): State<Arc<KernelGym>>) -> Response {
    let (processing, held, processed) = face.table().counts();
    Json(json!({
        "status": "healthy",
        "timestamp": iso(SystemTime::now()),
        "gpu_status": {},
        "queue_status": {"processing": processing, "results_held": held},
        "memory_usage": {},
        "active_tasks": processing,
        "total_processed": processed,
        "uptime": face.started.elapsed().as_secs_f64(),
    }))
    .into_response()
}

async fn root() -> Response {
    Json(json!({
        "name": "KernelGym",
        "version": "1.0.0",
        "description": "GPU Kernel Evaluation Service (kforge's KernelGym face)",
        "timestamp": iso(SystemTime::now()),
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_evaluator_s_fields_are_named_as_the_client_sent_them() {
        let error = JsonError::new(Code::InvalidArgument, "task.source: defines no get_inputs()", Some("task.source"));
        let renamed = upstream_field(&error);
        assert_eq!(renamed.field(), Some("reference_code"));
        assert_eq!(renamed.message(), "reference_code: defines no get_inputs()");
        let error = JsonError::new(Code::InvalidArgument, "candidate_source: too large", Some("candidate_source"));
        assert_eq!(upstream_field(&error).field(), Some("kernel_code"));
    }

    #[test]
    fn a_busy_evaluator_is_a_429_and_an_unreachable_one_a_503() {
        let busy = answer("t", Err(Rejection::Busy(JsonError::new(Code::ResourceExhausted, "queue full", None))));
        assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
        let down = answer("t", Err(Rejection::Busy(JsonError::new(Code::Unavailable, "no evaluator", None))));
        assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
        let invalid = answer("t", Err(Rejection::Invalid(JsonError::new(Code::InvalidArgument, "x: y", Some("x")))));
        assert_eq!(invalid.status(), StatusCode::BAD_REQUEST);
        assert_eq!(invalid.headers()["x-error-code"], "VALIDATION_ERROR");
    }
}
