//! The string fields: a `u16` byte length, then UTF-8, at most [`MAX_TEXT`] bytes.

use super::MAX_TEXT;
use super::decode::Body;
use super::error::WireError;

/// Appends `text`, cut at a character boundary to at most [`MAX_TEXT`] bytes.
pub(super) fn put_text(out: &mut Vec<u8>, text: &str) {
    let text = tern_metadata::text::truncate_at_char_boundary(text, MAX_TEXT);
    out.extend_from_slice(&(text.len() as u16).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

impl Body<'_> {
    /// A string field.
    pub(super) fn text(&mut self) -> Result<String, WireError> {
        let len = usize::from(self.u16()?);
        if len > MAX_TEXT {
            return Err(self.bad(format!("a string of {len} bytes")));
        }
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| self.bad("a string that is not UTF-8"))
    }
}
