//! (placeholder)

use super::Faces;

pub(super) fn router(_faces: Faces) -> axum::Router {
    axum::Router::new()
}
