//! Token sampling (OWNED BY THE SAMPLING HELPER).
