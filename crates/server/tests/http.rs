//! The HTTP layer through the router (tower `oneshot`, no socket) over a scripted engine that
//! replays fixed tokens, with the default model's tokenizer (skipped when the model is missing).

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures::StreamExt;
use pagoda_ops::attention::SparseAttention;
use pagoda_server::auth::ApiKeys;
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;

use common::*;

#[tokio::test]
async fn whole_completion_text_usage_and_finish_reasons() {
    let Some(h) = harness("Hello world, the end", Mode::Replay, |_| {}) else {
        return;
    };
    let (status, body) = call(
        &h.app,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 2}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let value: Value = serde_json::from_str(&body).unwrap();
    let script = h.tokenizer.encode("Hello world, the end", false).unwrap();
    assert_eq!(
        value["choices"][0]["text"],
        h.tokenizer.decode(&script[..2])
    );
    assert_eq!(value["choices"][0]["finish_reason"], "length");
    let prompt_tokens = h.tokenizer.encode("hi", true).unwrap().len();
    assert_eq!(
        value["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": prompt_tokens + 2})
    );
    // Run to EOS: the whole text, EOS hidden, finish "stop".
    let (_, body) = call(
        &h.app,
        "/v1/completions",
        json!({"prompt": "hi", "model": "test-model.gguf"}).to_string(),
        None,
    )
    .await;
    let value: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(value["choices"][0]["text"], "Hello world, the end");
    assert_eq!(value["choices"][0]["finish_reason"], "stop");
    assert_eq!(value["usage"]["completion_tokens"], script.len() + 1);
}

#[tokio::test]
async fn stop_strings_cut_and_cancel_the_request() {
    let Some(h) = harness("Hello world, the end", Mode::Replay, |_| {}) else {
        return;
    };
    let body = json!({"prompt": "hi", "stop": [", the", "zz"], "stream": true});
    let (status, text) = call(&h.app, "/v1/completions", body.to_string(), None).await;
    assert_eq!(status, StatusCode::OK);
    let mut joined = String::new();
    let mut finish = Value::Null;
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(line).unwrap();
        let piece = chunk["choices"][0]["text"].as_str().unwrap();
        assert!(
            !piece.contains(','),
            "a partial stop string leaked: {piece:?}"
        );
        joined.push_str(piece);
        if !chunk["choices"][0]["finish_reason"].is_null() {
            finish = chunk["choices"][0]["finish_reason"].clone();
        }
    }
    assert!(text.trim_end().ends_with("data: [DONE]"));
    assert_eq!(joined, "Hello world");
    assert_eq!(finish, "stop");
    // The engine request is cancelled once the stream is done (within 5 s: a loaded CI
    // machine may take a while to run the engine loop's next turn).
    for _ in 0..1000 {
        if !h.cancelled.lock().unwrap().is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the request was not cancelled after its stop string");
}

#[tokio::test]
async fn chat_stream_has_role_content_logprobs_and_usage() {
    let Some(h) = harness("Hi there", Mode::Replay, |_| {}) else {
        return;
    };
    let body = json!({"messages": [{"role": "user", "content": "yo"}], "stream": true,
        "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2});
    let (status, text) = call(&h.app, "/v1/chat/completions", body.to_string(), None).await;
    assert_eq!(status, StatusCode::OK);
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "Hi there");
    let entries: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .collect();
    assert!(!entries.is_empty());
    for entry in &entries {
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(entry["top_logprobs"][0]["logprob"], -0.5); // the scripted row's best
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    let counted = h.tokenizer.encode("Hi there", false).unwrap().len() + 1;
    assert_eq!(last["usage"]["completion_tokens"], counted);
    // The end token is counted and listed (its text is not in the content).
    assert_eq!(entries.len(), counted);
    let eos = String::from_utf8_lossy(&h.tokenizer.token_bytes(EOS)).into_owned();
    assert_eq!(entries.last().unwrap()["token"], eos.as_str());
}

#[tokio::test]
async fn a_dropped_stream_is_cancelled() {
    let Some(h) = harness("a b c d e f g h i j k l m n o p", Mode::Replay, |_| {}) else {
        return;
    };
    let request = Request::post("/v1/completions")
        .body(Body::from(
            json!({"prompt": "hi", "max_tokens": 50, "stream": true}).to_string(),
        ))
        .unwrap();
    let response = h.app.clone().oneshot(request).await.unwrap();
    let mut stream = response.into_body().into_data_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    for _ in 0..1000 {
        if h.cancelled.lock().unwrap().len() == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("a client that went away was not cancelled");
}

#[tokio::test]
async fn bad_input_gets_openai_errors() {
    let Some(h) = harness("x", Mode::Replay, |c| {
        c.api_keys = ApiKeys::new(["k"]).unwrap()
    }) else {
        return;
    };
    let chat = |body: Value| body.to_string();
    let ok = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (s, b) = call(&h.app, "/v1/chat/completions", chat(ok.clone()), None).await;
    error_of(s, &b, StatusCode::UNAUTHORIZED);
    let (s, b) = call(
        &h.app,
        "/v1/chat/completions",
        chat(ok.clone()),
        Some("wrong"),
    )
    .await;
    error_of(s, &b, StatusCode::UNAUTHORIZED);
    let (s, b) = call(&h.app, "/v1/chat/completions", "{not json", Some("k")).await;
    error_of(s, &b, StatusCode::BAD_REQUEST);
    let (s, b) = call(
        &h.app,
        "/v1/chat/completions",
        chat(json!({"messages": [], "model": "test-model"})),
        Some("k"),
    )
    .await;
    assert_eq!(
        error_of(s, &b, StatusCode::BAD_REQUEST)["param"],
        "messages"
    );
    let (s, b) = call(
        &h.app,
        "/v1/chat/completions",
        chat(json!({"messages": ok["messages"], "model": "gpt-4"})),
        Some("k"),
    )
    .await;
    assert_eq!(
        error_of(s, &b, StatusCode::NOT_FOUND)["code"],
        "model_not_found"
    );
    let (s, b) = call(
        &h.app,
        "/v1/completions",
        chat(json!({"prompt": "hi", "max_tokens": 100})),
        Some("k"),
    )
    .await;
    let error = error_of(s, &b, StatusCode::BAD_REQUEST);
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("64") && message.contains("100"),
        "{message}"
    );
    let (s, b) = call(
        &h.app,
        "/v1/completions",
        chat(json!({"prompt": "x".repeat(5000)})),
        Some("k"),
    )
    .await;
    error_of(s, &b, StatusCode::PAYLOAD_TOO_LARGE);
    let (s, b) = call(
        &h.app,
        "/v1/completions",
        chat(json!({"prompt": [999999]})),
        Some("k"),
    )
    .await;
    assert_eq!(error_of(s, &b, StatusCode::BAD_REQUEST)["param"], "prompt");
    // Health stays open without a key; metrics need it (tests/auth.rs has every rule).
    let response = h
        .app
        .clone()
        .oneshot(Request::get("/health").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let response = h
        .app
        .clone()
        .oneshot(
            Request::get("/metrics")
                .header("authorization", "Bearer k")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let text = String::from_utf8(
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap();
    assert!(
        text.contains("pagoda_requests_total{endpoint=\"/v1/chat/completions\",status=\"401\"} 2"),
        "{text}"
    );
}

#[tokio::test]
async fn a_full_queue_answers_429() {
    let Some(h) = harness("x", Mode::Replay, |c| c.max_queue = 0) else {
        return;
    };
    let (s, b) = call(
        &h.app,
        "/v1/completions",
        json!({"prompt": "hi"}).to_string(),
        None,
    )
    .await;
    assert_eq!(
        error_of(s, &b, StatusCode::TOO_MANY_REQUESTS)["type"],
        "rate_limit_error"
    );
    // The answer says when to come back.
    let response = h
        .app
        .clone()
        .oneshot(
            Request::post("/v1/completions")
                .header("content-type", "application/json")
                .body(Body::from(json!({"prompt": "hi"}).to_string()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "1");
}

#[tokio::test]
async fn a_wrong_method_gets_a_405_with_the_openai_body() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let request = Request::get("/v1/chat/completions")
        .body(Body::empty())
        .unwrap();
    let (status, body) = answer(&h.app, request).await;
    let error = error_of(status, &body, StatusCode::METHOD_NOT_ALLOWED);
    assert!(error["message"].as_str().unwrap().contains("GET"), "{body}");
}

#[tokio::test]
async fn response_ids_differ_across_restarts() {
    let body = || json!({"prompt": "hi", "max_tokens": 2}).to_string();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let Some(h) = harness("Hello", Mode::Replay, |_| {}) else {
            return;
        };
        let (s, b) = call(&h.app, "/v1/completions", body(), None).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let value: Value = serde_json::from_str(&b).unwrap();
        ids.push(value["id"].as_str().unwrap().to_owned());
    }
    assert!(ids[0].starts_with("cmpl-"), "{ids:?}");
    assert_ne!(ids[0], ids[1], "a restarted server reused an id");
}

#[tokio::test]
async fn engine_errors_and_panics_fail_the_request_not_the_server() {
    for mode in [Mode::FailSteps, Mode::Panic] {
        let Some(h) = harness("x", mode, |_| {}) else {
            return;
        };
        for _ in 0..2 {
            let (s, b) = call(
                &h.app,
                "/v1/completions",
                json!({"prompt": "hi"}).to_string(),
                None,
            )
            .await;
            let error = error_of(s, &b, StatusCode::INTERNAL_SERVER_ERROR);
            assert!(
                error["message"].as_str().unwrap().contains("scripted"),
                "{error}"
            );
        }
    }
}

#[tokio::test]
async fn requests_that_can_never_run_are_400s_saying_what_to_change() {
    let Some(h) = harness("Hello", Mode::SmallPool, |_| {}) else {
        return;
    };
    // Larger than the whole KV pool: a property of the request, not a server fault.
    let body = json!({"prompt": "hi", "max_tokens": 20}).to_string();
    let (s, b) = call(&h.app, "/v1/completions", body, None).await;
    let error = error_of(s, &b, StatusCode::BAD_REQUEST);
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("max_tokens") && message.contains("--kv-pages"),
        "{message}"
    );
    let body = json!({"prompt": "hi", "max_tokens": 4}).to_string();
    let (s, b) = call(&h.app, "/v1/completions", body, None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    // Roles outside the OpenAI API are refused, as OpenAI does.
    for role in ["wizard", "", "USER"] {
        let body = json!({"messages": [{"role": role, "content": "hi"}], "max_tokens": 2});
        let (s, b) = call(&h.app, "/v1/chat/completions", body.to_string(), None).await;
        let error = error_of(s, &b, StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], "messages");
        assert!(
            error["message"].as_str().unwrap().contains("is not one of"),
            "{b}"
        );
    }
    for role in ["system", "developer", "user", "assistant", "tool"] {
        let body = json!({"messages": [{"role": role, "content": "hi"}], "max_tokens": 2});
        let (s, b) = call(&h.app, "/v1/chat/completions", body.to_string(), None).await;
        assert_eq!(s, StatusCode::OK, "{role}: {b}");
    }
}

#[tokio::test]
async fn the_sparse_attention_field_is_accepted_and_bad_values_refused() {
    let Some(h) = harness("Hello", Mode::Replay, |_| {}) else {
        return;
    };
    for good in [
        json!({"budget": 512, "window": 64, "min_context": 1024}),
        json!({"budget": 256, "min-context": 0}),
        json!(false),
        json!(true),
        Value::Null,
    ] {
        let body = json!({"prompt": "hi", "max_tokens": 2, "sparse_attention": good});
        let (s, b) = call(&h.app, "/v1/completions", body.to_string(), None).await;
        assert_eq!(s, StatusCode::OK, "{good}: {b}");
    }
    for bad in [
        json!({"budget": 0}),
        json!({"budget": 64, "window": 128}),
        json!({"budget": "512"}),
        json!({"depth": 3}),
        json!("budget=512"),
    ] {
        let body =
            json!({"messages": [{"role": "user", "content": "hi"}], "sparse_attention": bad});
        let (s, b) = call(&h.app, "/v1/chat/completions", body.to_string(), None).await;
        assert_eq!(
            error_of(s, &b, StatusCode::BAD_REQUEST)["param"],
            "sparse_attention",
            "{bad}"
        );
    }
    // Keys a request leaves out take the server's setting (budget 512, window 64), which also
    // bounds the keys it gives.
    h.sparse.lock().unwrap().clear();
    for (given, expected) in [
        (json!({"window": 32}), (512, 32, 2048)),
        (json!({"budget": 2048}), (2048, 64, 2048)),
        (json!(true), (512, 64, 2048)),
    ] {
        let body = json!({"prompt": "hi", "max_tokens": 2, "sparse_attention": given});
        let (s, b) = call(&h.app, "/v1/completions", body.to_string(), None).await;
        assert_eq!(s, StatusCode::OK, "{given}: {b}");
        let (budget, window, min_context) = expected;
        assert_eq!(
            h.sparse.lock().unwrap().pop(),
            Some(Some(
                SparseAttention::new(budget, window, min_context).unwrap()
            )),
            "{given}"
        );
    }
    let body = json!({"prompt": "hi", "max_tokens": 2, "sparse_attention": {"window": 600}});
    let (s, b) = call(&h.app, "/v1/completions", body.to_string(), None).await;
    assert_eq!(
        error_of(s, &b, StatusCode::BAD_REQUEST)["param"],
        "sparse_attention"
    );
    // A server without sparse decode refuses settings in the handler, naming the field (and
    // takes `false`).
    let Some(plain) = harness("Hello", Mode::SmallPool, |_| {}) else {
        return;
    };
    for given in [json!({"budget": 512}), json!(true)] {
        let body = json!({"prompt": "hi", "max_tokens": 2, "sparse_attention": given});
        let (s, b) = call(&plain.app, "/v1/completions", body.to_string(), None).await;
        let error = error_of(s, &b, StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], "sparse_attention", "{b}");
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .contains("--sparse-attention"),
            "{b}"
        );
    }
    assert!(
        plain.sparse.lock().unwrap().is_empty(),
        "refused before the engine"
    );
    let body = json!({"prompt": "hi", "max_tokens": 2, "sparse_attention": false});
    let (s, b) = call(&plain.app, "/v1/completions", body.to_string(), None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
}

#[tokio::test]
async fn a_queued_client_that_leaves_frees_its_place() {
    let words = (0..80)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let Some(h) = harness(&words, Mode::Replay, |c| {
        c.parallel = 1;
        c.max_queue = 1;
    }) else {
        return;
    };
    let stream = |max_tokens: usize| {
        Request::post("/v1/completions")
            .body(Body::from(
                json!({"prompt": "hi", "max_tokens": max_tokens, "stream": true}).to_string(),
            ))
            .unwrap()
    };
    // A runs (about 60 steps of 2 ms); B waits in the one queue place, then leaves.
    let running = h.app.clone().oneshot(stream(60)).await.unwrap();
    let mut running = running.into_body().into_data_stream();
    running.next().await.unwrap().unwrap();
    let queued = h.app.clone().oneshot(stream(4)).await.unwrap();
    assert_eq!(queued.status(), StatusCode::OK);
    drop(queued);
    // C gets B's place while A still runs.
    let started = std::time::Instant::now();
    loop {
        let response = h.app.clone().oneshot(stream(4)).await.unwrap();
        if response.status() == StatusCode::OK {
            break;
        }
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(
            started.elapsed() < Duration::from_millis(60),
            "a queued client that left kept its place"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // A was not disturbed: it still streams to its end.
    let mut rest = 0;
    while let Some(chunk) = running.next().await {
        rest += chunk.unwrap().len();
    }
    assert!(rest > 0);
}
