//! `/v1/embeddings` and `/slots` through the router over the scripted engine: the OpenAI
//! input forms, one vector per input in order, float and base64 encodings, usage, and a 400
//! naming the field for each bad request. (The vectors' values are checked against a numpy
//! forward pass in tests/server/test_embeddings.py.)

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine as _;
use serde_json::{json, Value};

use common::*;

async fn embed(h: &Harness, body: Value) -> (StatusCode, Value) {
    let (status, text) = call(&h.app, "/v1/embeddings", body.to_string(), None).await;
    (status, serde_json::from_str(&text).unwrap())
}

#[tokio::test]
async fn every_input_form_gives_one_vector_per_input_in_order() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let hello = h.tokenizer.encode("hello world", true).unwrap();
    let (status, one) = embed(&h, json!({"model": "test-model", "input": "hello world"})).await;
    assert_eq!(status, StatusCode::OK, "{one}");
    assert_eq!(one["object"], "list");
    assert_eq!(one["model"], "test-model");
    let n = hello.len();
    let expected = json!([n as f32, hello[0] as f32, hello[n - 1] as f32]);
    assert_eq!(
        one["data"][0],
        json!({"object": "embedding", "index": 0, "embedding": expected})
    );
    assert_eq!(one["usage"], json!({"prompt_tokens": n, "total_tokens": n}));

    let (_, ids) = embed(&h, json!({"input": hello})).await;
    assert_eq!(ids["data"][0]["embedding"], expected);
    let (_, many) = embed(&h, json!({"input": [[5, 6, 7], [9]]})).await;
    assert_eq!(many["data"][0]["embedding"], json!([3.0, 5.0, 7.0]));
    assert_eq!(
        many["data"][1],
        json!({"object": "embedding", "index": 1, "embedding": [1.0, 9.0, 9.0]})
    );
    assert_eq!(many["usage"]["prompt_tokens"], 4);
    let (_, texts) = embed(&h, json!({"input": ["hello world", "hi"]})).await;
    assert_eq!(texts["data"][0]["embedding"], expected);
    assert_eq!(texts["data"].as_array().unwrap().len(), 2);

    // base64: the little-endian f32 bytes of the same numbers.
    let (_, packed) = embed(
        &h,
        json!({"input": [[5, 6, 7]], "encoding_format": "base64"}),
    )
    .await;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(packed["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values, [3.0, 5.0, 7.0]);

    // llama-server's path answers the same.
    let (status, text) = call(
        &h.app,
        "/embeddings",
        json!({"input": [9]}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
}

#[tokio::test]
async fn bad_embedding_requests_are_400_naming_the_field() {
    let Some(h) = harness("x", Mode::SmallPool, |c| c.max_body_bytes = 1 << 20) else {
        return;
    };
    let too_many: Vec<Value> = (0..2049).map(|_| json!("a")).collect();
    for (body, param, words) in [
        (json!({}), "input", "required"),
        (json!({"input": ""}), "input", "empty"),
        (json!({"input": []}), "input", "empty"),
        (json!({"input": [[1], []]}), "input", "input 1 is empty"),
        (json!({"input": 5}), "input", "must be"),
        (json!({"input": [1, "a"]}), "input", "must be"),
        (json!({"input": [1.5]}), "input", "whole number"),
        (json!({"input": [-1]}), "input", "whole number"),
        (json!({"input": [100_000_000]}), "input", "vocabulary"),
        (json!({"input": vec![1; 65]}), "input", "context"),
        (json!({"input": vec![1; 20]}), "input", "pool"),
        (json!({"input": too_many}), "input", "at most 2048"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
            "base64",
        ),
        (
            json!({"input": "a", "dimensions": 8}),
            "dimensions",
            "not supported",
        ),
    ] {
        let (status, text) = call(&h.app, "/v1/embeddings", body.to_string(), None).await;
        let error = error_of(status, &text, StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{body}: {text}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(words), "{body}: {message}");
    }
    let (status, text) = call(
        &h.app,
        "/v1/embeddings",
        json!({"input": "a", "model": "other"}).to_string(),
        None,
    )
    .await;
    error_of(status, &text, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn slots_show_each_parallel_sequence() {
    let Some(h) = harness(
        "a b c d e f g h i j k l m n o p q r s t",
        Mode::Replay,
        |_| {},
    ) else {
        return;
    };
    let get = |app: axum::Router| async move {
        let request = Request::get("/slots").body(Body::empty()).unwrap();
        let (status, text) = answer(&app, request).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let idle = get(h.app.clone()).await;
    assert_eq!(idle.as_array().unwrap().len(), 2, "{idle}");
    assert_eq!(idle[0]["is_processing"], false);
    assert_eq!(idle[1]["id"], 1);
    assert_eq!(idle[0]["n_ctx"], 64);
    // A streamed request, read one event at a time, holds slot 0 while it runs.
    let body = json!({"prompt": "hi there", "stream": true, "max_tokens": 40});
    let request = Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = tower::ServiceExt::oneshot(h.app.clone(), request)
        .await
        .unwrap();
    let mut stream = response.into_body().into_data_stream();
    use futures::StreamExt;
    let _first = stream.next().await;
    let mut busy = Value::Null;
    for _ in 0..400 {
        busy = get(h.app.clone()).await;
        if busy[0]["is_processing"] == true && busy[0]["next_token"]["n_decoded"].as_u64() > Some(0)
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(busy[0]["is_processing"], true, "{busy}");
    assert_eq!(busy[0]["n_prompt_tokens"], 2, "{busy}");
    assert_eq!(busy[0]["params"]["seed"], 7);
    assert_eq!(busy[1]["is_processing"], false);
    drop(stream);
}
