//! What a check reports: a finding, with its stable code, message, line and category.

/// What kind of problem a finding is (the wire's `FindingCategory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    Hack,
    Policy,
    Notice,
}

/// One problem in a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub code: &'static str,
    pub message: String,
    pub line: u32,
    pub category: Category,
}

pub(super) fn finding(code: &'static str, message: String, line: u32, category: Category) -> Finding {
    Finding { code, message, line, category }
}
