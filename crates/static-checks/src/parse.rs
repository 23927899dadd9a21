//! The Python parse every check reads (tree-sitter), and the walk over it.

use tree_sitter::{Node, Parser};

pub(super) struct Source<'a> {
    pub(super) text: &'a [u8],
}

impl<'a> Source<'a> {
    pub(super) fn text(&self, node: Node<'_>) -> &'a str {
        node.utf8_text(self.text).unwrap_or("")
    }
}

pub(super) fn line(node: Node<'_>) -> u32 {
    node.start_position().row as u32 + 1
}

pub(super) fn parse(source: &str) -> Option<tree_sitter::Tree> {
    let mut parser = Parser::new();
    parser.set_language(&tree_sitter_python::LANGUAGE.into()).ok()?;
    parser.parse(source, None)
}

/// The first syntax error: (line, what).
pub(super) fn syntax_error(root: Node<'_>) -> Option<(u32, String)> {
    if !root.has_error() {
        return None;
    }
    let mut found = None;
    walk(root, &mut |node| {
        if found.is_none() && (node.is_error() || node.is_missing()) {
            let what =
                if node.is_missing() { format!("missing `{}`", node.kind()) } else { "invalid syntax".to_owned() };
            found = Some((line(node), what));
        }
    });
    Some(found.unwrap_or((1, "invalid syntax".to_owned())))
}

pub(super) fn walk<'t>(node: Node<'t>, visit: &mut impl FnMut(Node<'t>)) {
    visit(node);
    let mut cursor = node.walk();
    for child in node.children(&mut cursor) {
        walk(child, visit);
    }
}
