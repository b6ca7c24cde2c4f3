//! The escaping of keys in a request's query: RFC 3986 percent-encoding.

/// Percent-encodes everything but RFC 3986 unreserved characters.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Decodes `%XX` escapes and `+` (as space); `None` on a malformed escape or bad UTF-8.
pub fn unescape(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_round_trips() {
        let key = "mooncake/c1/ram/10.0.0.1:1234/x y+z";
        assert_eq!(
            escape(key),
            "mooncake%2Fc1%2Fram%2F10.0.0.1%3A1234%2Fx%20y%2Bz"
        );
        assert_eq!(unescape(&escape(key)).as_deref(), Some(key));
        assert_eq!(unescape("%zz"), None);
        assert_eq!(unescape("%4"), None);
    }
}
