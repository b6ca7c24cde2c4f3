//! Requests to the HTTP metadata server (Mooncake's protocol: `<METHOD> <path>?key=<escaped
//! key> HTTP/1.1`, headers, a `Content-Length` body, or `GET /metrics`):
//! `tern_metadata::http::parse_http_request`, which every Tern HTTP listener runs on each
//! connection. Properties: a metrics request is a GET of `/metrics`; an accepted metadata
//! request has a method and a non-empty key, its body is the bytes just before where parsing
//! stopped, and written again the way `HttpStore` writes requests it parses back equal;
//! `escape` → `unescape` is the identity on any text.
#![cfg_attr(fuzzing, no_main)]

use tern_metadata::http::{HttpRequest, escape, parse_http_request, parse_request, unescape};

tern_fuzz::target!(|data| {
    if let Ok(text) = std::str::from_utf8(data) {
        assert_eq!(unescape(&escape(text)).as_deref(), Some(text));
    }
    let mut reader = data;
    let request = match parse_http_request(&mut reader) {
        Ok(HttpRequest::Metadata(request)) => request,
        Ok(HttpRequest::Metrics) => {
            let line = data.split(|&b| b == b'\n').next().unwrap_or_default();
            let mut words = line
                .split(|b| b.is_ascii_whitespace())
                .filter(|w| !w.is_empty());
            assert_eq!(words.next(), Some(&b"GET"[..]));
            let target = words.next().unwrap_or_default();
            assert!(target.split(|&b| b == b'?').next() == Some(&b"/metrics"[..]));
            return;
        }
        Err(_) => return,
    };
    assert!(!request.key.is_empty());
    assert!(!request.method.is_empty() && !request.method.contains(char::is_whitespace));
    let consumed = data.len() - reader.len();
    assert_eq!(
        &data[consumed - request.body.len()..consumed],
        &request.body[..]
    );
    let token = request
        .token
        .as_ref()
        .map(|t| format!("X-Tern-Auth: {t}\r\n"))
        .unwrap_or_default();
    let mut again = format!(
        "{} /metadata?key={} HTTP/1.1\r\nHost: h:1\r\n{token}Content-Length: {}\r\n\r\n",
        request.method,
        escape(&request.key),
        request.body.len()
    )
    .into_bytes();
    again.extend_from_slice(&request.body);
    let reparsed = parse_request(&mut &again[..]).expect("a request as HttpStore writes it");
    assert_eq!(reparsed, request);
});
