//! Requests and replies read off the wire: the request parser every Tern HTTP listener runs
//! and the reply parser the client runs, both bounded in line, header and body length.

use std::collections::HashMap;
use std::io::{BufRead, Read};

use super::{METRICS_PATH, unescape};
use crate::seal;

/// Longest request, status or header line accepted.
const MAX_LINE: usize = 16 * 1024;

/// Largest request or response body accepted (descriptors of huge nodes stay far below).
const MAX_BODY: usize = 32 << 20;

/// What a client asked of a Tern HTTP listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpRequest {
    /// A request of Mooncake's metadata protocol.
    Metadata(MetadataRequest),
    /// `GET /metrics`.
    Metrics,
}

/// A request to the HTTP metadata server, as read off the wire by [`parse_request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataRequest {
    /// The request line's method, as sent (`GET`, `PUT`, `DELETE`; others are answered 405).
    pub method: String,
    /// The unescaped value of the `key` query parameter; never empty.
    pub key: String,
    /// The body (`Content-Length` bytes; empty without that header).
    pub body: Vec<u8>,
    /// The delete token header ([`seal::DELETE_HEADER`]), if sent.
    pub token: Option<String>,
}

/// Reads one request of Mooncake's HTTP metadata protocol (`<METHOD> <path>?key=<escaped
/// key> HTTP/1.1`, headers, and a `Content-Length` body) or a `GET /metrics` from bytes a
/// client sent: what every Tern HTTP listener runs on each connection, public so that it can
/// be fuzzed. `Err` names what is wrong (the server answers it with a 400). It only reads; it
/// must not act on the request.
pub fn parse_http_request(reader: &mut impl BufRead) -> Result<HttpRequest, String> {
    let (_, headers) = read_head(reader, false)?;
    let line = headers.get(":line").cloned().unwrap_or_default();
    let mut parts = line.split_ascii_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    // A method is a token: visible ASCII.
    if !method.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!("bad method {method:?}"));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if method == "GET" && path == METRICS_PATH {
        return Ok(HttpRequest::Metrics);
    }
    let key = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("key="))
        .and_then(unescape)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| format!("no key in {target:?}"))?;
    let body = read_body(reader, &headers, false)?;
    let token = headers
        .get(&seal::DELETE_HEADER.to_ascii_lowercase())
        .cloned();
    Ok(HttpRequest::Metadata(MetadataRequest {
        method: method.to_owned(),
        key,
        body,
        token,
    }))
}

/// [`parse_http_request`] of a metadata request: a `GET /metrics` is an error here.
pub fn parse_request(reader: &mut impl BufRead) -> Result<MetadataRequest, String> {
    match parse_http_request(reader)? {
        HttpRequest::Metadata(request) => Ok(request),
        HttpRequest::Metrics => Err(format!("no key in {METRICS_PATH:?}")),
    }
}

/// Reads the server's reply to one request (status line, headers, and a body of
/// `Content-Length` bytes or up to the end of the stream): what
/// [`HttpStore`](super::HttpStore) runs on every reply, public so that it can be fuzzed.
/// Returns the status code and the body; it only reads.
pub fn parse_response(reader: &mut impl BufRead) -> Result<(u16, Vec<u8>), String> {
    let (status, headers) = read_head(reader, true)?;
    let body = read_body(reader, &headers, true)?;
    Ok((status, body))
}

/// Reads a status line (or request line) and headers. For a response the first value is the
/// status code; for a request it is 0 and the line is returned as the `:line` header.
fn read_head(
    reader: &mut impl BufRead,
    response: bool,
) -> Result<(u16, HashMap<String, String>), String> {
    let mut line = String::new();
    let mut headers = HashMap::new();
    // Bounded like every header line: a peer sending one endless line gets an error, not
    // our memory.
    reader
        .take(MAX_LINE as u64)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    if line.len() >= MAX_LINE && !line.ends_with('\n') {
        return Err(format!(
            "request or status line longer than {MAX_LINE} bytes"
        ));
    }
    if line.is_empty() {
        return Err("connection closed before a reply".into());
    }
    // HTTP separates a request or status line's parts with ASCII spaces and ends it with
    // CR LF; other whitespace (U+2001, say) is part of a word, not a separator (found by
    // fuzzing: `GET /metrics\u{2001}…` was taken for `GET /metrics`).
    let first = line
        .trim_end_matches(|c: char| c.is_ascii_whitespace())
        .to_owned();
    // Only a reply's first line is a status line: a request whose method happens to read
    // "HTTP/…" is still a request (found by fuzzing).
    let status = if response {
        first
            .strip_prefix("HTTP/")
            .and_then(|rest| rest.split_ascii_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {first:?}"))?
    } else {
        0
    };
    headers.insert(":line".to_owned(), first);
    loop {
        line.clear();
        reader
            .take(MAX_LINE as u64)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if headers.len() > 100 {
            return Err("too many headers".into());
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    Ok((status, headers))
}

fn read_body(
    reader: &mut impl Read,
    headers: &HashMap<String, String>,
    to_eof: bool,
) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    match headers.get("content-length") {
        Some(len) => {
            let len: usize = len
                .parse()
                .map_err(|_| format!("bad Content-Length {len:?}"))?;
            if len > MAX_BODY {
                return Err(format!("body of {len} bytes is too large"));
            }
            // Grows with the bytes that arrive: a bare `Content-Length` costs nothing.
            reader
                .take(len as u64)
                .read_to_end(&mut body)
                .map_err(|e| e.to_string())?;
            if body.len() != len {
                return Err(format!("body ended after {} of {len} bytes", body.len()));
            }
        }
        None if to_eof => {
            reader
                .take(MAX_BODY as u64 + 1)
                .read_to_end(&mut body)
                .map_err(|e| e.to_string())?;
            if body.len() > MAX_BODY {
                return Err("body too large".into());
            }
        }
        None => {}
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_first_line_is_refused_without_reading_it_all() {
        let mut endless = std::io::BufReader::new(std::io::repeat(b'x'));
        let error = read_head(&mut endless, false).unwrap_err();
        assert!(error.contains("longer than"), "{error}");
    }

    #[test]
    fn a_request_whose_method_reads_like_a_status_line_is_still_a_request() {
        let wire = b"HTTP/1.1 /metadata?key=b%08 HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
        let request = parse_request(&mut &wire[..]).unwrap();
        assert_eq!(
            (request.method.as_str(), request.key.as_str()),
            ("HTTP/1.1", "b\u{8}")
        );
    }

    #[test]
    fn only_ascii_spaces_separate_the_request_line() {
        // Found by fuzzing: U+2001 after the path made `GET /metrics` of another target.
        let wire = "    GET /metrics\u{2001}\u{3}GMT\0\0\x31Oson     ".as_bytes();
        assert!(!matches!(
            parse_http_request(&mut &wire[..]),
            Ok(HttpRequest::Metrics)
        ));
        let wire = "GET /metrics\u{2001}\r\n\r\n".as_bytes();
        assert!(!matches!(
            parse_http_request(&mut &wire[..]),
            Ok(HttpRequest::Metrics)
        ));
        let wire = "GET\u{2001}X /m?key=k HTTP/1.1\r\n\r\n".as_bytes();
        let error = parse_request(&mut &wire[..]).unwrap_err();
        assert!(error.contains("bad method"), "{error}");
        assert!(matches!(
            parse_http_request(&mut &b"GET /metrics HTTP/1.1\r\n\r\n"[..]),
            Ok(HttpRequest::Metrics)
        ));
    }

    #[test]
    fn requests_parse_and_a_short_body_is_named() {
        let wire =
            b"PUT /metadata?key=mooncake%2Fram%2Fa HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}tail";
        let mut reader = &wire[..];
        let request = parse_request(&mut reader).unwrap();
        assert_eq!(
            request,
            MetadataRequest {
                method: "PUT".into(),
                key: "mooncake/ram/a".into(),
                body: b"{}".to_vec(),
                token: None,
            }
        );
        assert_eq!(reader, b"tail");
        // A length the body never reaches, just under the limit (found by fuzzing, where
        // each such request cost a 32 MiB buffer before any byte of it arrived).
        let short = format!(
            "PUT /m?key=k HTTP/1.1\r\nContent-Length: {}\r\n\r\nab",
            MAX_BODY
        );
        let err = parse_request(&mut short.as_bytes()).unwrap_err();
        assert!(
            err.contains(&format!("after 2 of {MAX_BODY} bytes")),
            "{err}"
        );
        let err = parse_request(&mut &b"GET /m HTTP/1.1\r\n\r\n"[..]).unwrap_err();
        assert!(err.contains("no key"), "{err}");
        assert_eq!(
            parse_response(&mut &b"HTTP/1.1 404 Not Found\r\n\r\ngone"[..]).unwrap(),
            (404, b"gone".to_vec())
        );
    }
}
