//! Text put on the wire with a length limit: names in authentication frames here, and in the
//! frames of other crates' protocols.

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary: a
/// string cut to fit a length field, still valid UTF-8.
pub fn truncate_at_char_boundary(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_never_splits_a_character() {
        assert_eq!(truncate_at_char_boundary("node-a", 4), "node");
        assert_eq!(truncate_at_char_boundary("node-a", 64), "node-a");
        assert_eq!(truncate_at_char_boundary("node-a", 0), "");
        // "é" is two bytes, "€" three: a cut inside either goes back to its start.
        assert_eq!(truncate_at_char_boundary("éé", 3), "é");
        assert_eq!(truncate_at_char_boundary("a€", 3), "a");
        assert_eq!(truncate_at_char_boundary("a€", 4), "a€");
    }
}
