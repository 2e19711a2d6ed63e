//! The `sparse_attention` body field (a pagoda extension): sparse decode's settings for one
//! request, with the keys of `--sparse-attention`. `{"budget": N, "window": W,
//! "min_context": C}` (any subset; `min-context` also accepted), `true` (no keys) or `false`
//! (dense for this request); absent or null: the server's setting. Keys a request leaves out
//! take the server's `--sparse-attention` values (a window left out also shrinks to a smaller
//! budget); only without a server setting the built-in defaults 1024, min(128, budget), 2048.
//! Settings on a server without sparse decode, bad values and unknown keys are a 400 naming
//! the field.

use pagoda_ops::attention::SparseAttention;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// The field's name.
pub const FIELD: &str = "sparse_attention";

/// A request's `sparse_attention` as its body gives it; [`resolve`] fills the keys it leaves
/// out from the server's setting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SparseRequest {
    /// Absent or null: the server's setting.
    #[default]
    Server,
    /// `false`: dense for this request.
    Dense,
    /// `true` (no keys) or an object: these keys over the server's setting.
    Keys(Vec<(String, usize)>),
}

fn bad(message: String) -> ApiError {
    ApiError::invalid(message, Some(FIELD))
}

/// Reads the field: its type, each key's name and that each value is a whole number (the
/// values together are checked by [`resolve`], against the server's setting).
pub fn parse(object: &Map<String, Value>) -> Result<SparseRequest, ApiError> {
    match object.get(FIELD) {
        None | Some(Value::Null) => Ok(SparseRequest::Server),
        Some(Value::Bool(false)) => Ok(SparseRequest::Dense),
        Some(Value::Bool(true)) => Ok(SparseRequest::Keys(Vec::new())),
        Some(Value::Object(map)) => {
            let mut keys = Vec::with_capacity(map.len());
            for (key, value) in map {
                let number = value
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(format!(
                            "`{FIELD}.{key}` must be a whole number of tokens, got {value}"
                        ))
                    })?;
                SparseAttention::default().set(key, number).map_err(bad)?;
                keys.push((key.clone(), number));
            }
            Ok(SparseRequest::Keys(keys))
        }
        Some(other) => Err(bad(format!(
            "`{FIELD}` must be an object {{\"budget\", \"window\", \"min_context\"}}, true or false, got {other}"
        ))),
    }
}

/// `keys` over `base` (the server's setting; the built-in defaults when `None`), checked.
pub fn merge(
    keys: &[(String, usize)],
    base: Option<SparseAttention>,
) -> Result<SparseAttention, String> {
    let mut settings = base.unwrap_or_default();
    let mut window_given = false;
    for (key, value) in keys {
        settings.set(key, *value)?;
        window_given |= key == "window";
    }
    settings.finish(window_given)
}

/// The settings request `request` runs with on a server whose sparse decode setting is
/// `server` (`None`: started without `--sparse-attention`, so no sparse decode): `None` the
/// server's, `Some(None)` dense, `Some(Some(s))` these. Bad values (after the merge) and
/// settings the server cannot run are a 400.
pub fn resolve(
    request: &SparseRequest,
    server: Option<SparseAttention>,
) -> Result<Option<Option<SparseAttention>>, ApiError> {
    let keys = match request {
        SparseRequest::Server => return Ok(None),
        SparseRequest::Dense => return Ok(Some(None)),
        SparseRequest::Keys(keys) => keys,
    };
    let settings = merge(keys, server).map_err(|error| match server {
        Some(server) => bad(format!(
            "{error} (keys left out take the server's --sparse-attention {server})"
        )),
        None => bad(error),
    })?;
    if server.is_none() {
        return Err(bad(format!(
            "`{FIELD}` needs a server started with --sparse-attention (the CPU backend); leave \
             it out or send false"
        )));
    }
    Ok(Some(Some(settings)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resolved(
        value: Value,
        server: Option<SparseAttention>,
    ) -> Result<Option<Option<SparseAttention>>, ApiError> {
        resolve(
            &parse(json!({ FIELD: value }).as_object().unwrap())?,
            server,
        )
    }

    fn settings(budget: usize, window: usize, min_context: usize) -> SparseAttention {
        SparseAttention::new(budget, window, min_context).unwrap()
    }

    #[test]
    fn accepts_the_keys_and_refuses_the_rest() {
        let server = Some(SparseAttention::default());
        assert_eq!(resolved(Value::Null, server).unwrap(), None);
        assert_eq!(resolved(json!(false), server).unwrap(), Some(None));
        assert_eq!(resolved(json!(false), None).unwrap(), Some(None));
        assert_eq!(
            resolved(
                json!({"budget": 512, "window": 32, "min_context": 1000}),
                server
            )
            .unwrap(),
            Some(Some(settings(512, 32, 1000)))
        );
        assert_eq!(
            resolved(json!({"budget": 64, "min-context": 0}), server).unwrap(),
            Some(Some(settings(64, 64, 0)))
        );
        for bad in [
            json!({"budget": 0}),
            json!({"budget": -3}),
            json!({"budget": 1.5}),
            json!({"budget": 64, "window": 128}),
            json!({"depth": 3}),
            json!("budget=512"),
            json!(3),
        ] {
            let error = resolved(bad.clone(), server).unwrap_err();
            assert_eq!(error.status, 400, "{bad}");
            assert_eq!(error.param.as_deref(), Some(FIELD));
        }
    }

    #[test]
    fn omitted_keys_come_from_the_server_setting() {
        let server = Some(settings(512, 64, 1000));
        assert_eq!(
            resolved(json!({"window": 32}), server).unwrap(),
            Some(Some(settings(512, 32, 1000)))
        );
        assert_eq!(
            resolved(json!({"budget": 2048}), server).unwrap(),
            Some(Some(settings(2048, 64, 1000)))
        );
        // A window left out still shrinks to a budget below it.
        assert_eq!(
            resolved(json!({"budget": 16}), server).unwrap(),
            Some(Some(settings(16, 16, 1000)))
        );
        assert_eq!(resolved(json!(true), server).unwrap(), server.map(Some));
        // Checked after the merge: the server's budget bounds a window the request gives.
        let error = resolved(json!({"window": 600}), server).unwrap_err();
        assert!(error.message.contains("budget=512"), "{}", error.message);
        // Without a server setting, the built-in defaults (for the check), then a refusal.
        assert_eq!(
            merge(&[("window".into(), 32)], None),
            Ok(settings(1024, 32, 2048))
        );
        assert!(merge(&[("window".into(), 600)], None).is_ok());
        for value in [json!({"window": 32}), json!(true)] {
            let error = resolved(value, None).unwrap_err();
            assert_eq!(error.status, 400);
            assert_eq!(error.param.as_deref(), Some(FIELD));
            assert!(
                error.message.contains("--sparse-attention"),
                "{}",
                error.message
            );
        }
    }
}
