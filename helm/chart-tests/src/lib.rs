//! Tests only: `tests/configmaps.rs` renders helm/kforge with each value set in helm/kforge/ci and loads every
//! service's ConfigMap through that service's config type.
