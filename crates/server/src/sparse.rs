//! The `sparse_attention` body field (a pagoda extension): sparse decode's settings for one
//! request, with the keys of `--sparse-attention`. `{"budget": N, "window": W,
//! "min_context": C}` (any subset; `min-context` also accepted; missing keys take the
//! defaults 1024, min(128, budget), 2048), `true` (the defaults) or `false` (dense for this
//! request); absent or null: the server's setting. Bad values and unknown keys are a 400.

use pagoda_ops::attention::SparseAttention;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// The field's name.
pub const FIELD: &str = "sparse_attention";

/// `None`: the server's setting; `Some(None)`: dense; `Some(Some(s))`: these settings.
pub fn parse(object: &Map<String, Value>) -> Result<Option<Option<SparseAttention>>, ApiError> {
    let bad = |message: String| ApiError::invalid(message, Some(FIELD));
    match object.get(FIELD) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(false)) => Ok(Some(None)),
        Some(Value::Bool(true)) => Ok(Some(Some(SparseAttention::default()))),
        Some(Value::Object(map)) => {
            let mut settings = SparseAttention::default();
            let mut window_given = false;
            for (key, value) in map {
                let number = value
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(format!(
                            "`{FIELD}.{key}` must be a whole number of tokens, got {value}"
                        ))
                    })?;
                settings.set(key, number).map_err(bad)?;
                window_given |= key == "window";
            }
            settings.finish(window_given).map(|s| Some(Some(s))).map_err(bad)
        }
        Some(other) => Err(bad(format!(
            "`{FIELD}` must be an object {{\"budget\", \"window\", \"min_context\"}}, true or false, got {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(value: Value) -> Result<Option<Option<SparseAttention>>, ApiError> {
        parse(json!({ FIELD: value }).as_object().unwrap())
    }

    #[test]
    fn accepts_the_keys_and_refuses_the_rest() {
        assert_eq!(parsed(Value::Null).unwrap(), None);
        assert_eq!(parsed(json!(false)).unwrap(), Some(None));
        assert_eq!(
            parsed(json!({"budget": 512, "window": 32, "min_context": 1000})).unwrap(),
            Some(Some(SparseAttention::new(512, 32, 1000).unwrap()))
        );
        assert_eq!(
            parsed(json!({"budget": 64, "min-context": 0})).unwrap(),
            Some(Some(SparseAttention::new(64, 64, 0).unwrap()))
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
            let error = parsed(bad.clone()).unwrap_err();
            assert_eq!(error.status, 400, "{bad}");
            assert_eq!(error.param.as_deref(), Some(FIELD));
        }
    }
}
