//! An S3-compatible bucket through `aws-sdk-s3`: custom endpoint, path-style addressing and static
//! credentials for MinIO and other S3 servers, or the AWS default chain.

use aws_sdk_s3::Client;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;

use crate::{Retries, StorageConfig, StorageError};

#[derive(Clone, Debug)]
pub struct S3Store {
    client: Client,
    /// Signs URLs for browsers: `client` itself, or one for the public endpoint.
    presigner: Client,
    bucket: String,
}

fn unavailable<E: ProvideErrorMetadata + std::error::Error + 'static, R: std::fmt::Debug>(
    op: &'static str,
    key: &str,
    e: SdkError<E, R>,
) -> StorageError {
    // The SDK's Display of a service error is just "service error"; the code and message say what happened.
    let message = match &e {
        SdkError::ServiceError(se) => {
            let err = se.err();
            format!(
                "{}: {}",
                err.code().unwrap_or("unknown"),
                err.message().unwrap_or("")
            )
        }
        other => DisplayErrorContext(other).to_string(),
    };
    StorageError::Unavailable {
        op,
        key: key.to_owned(),
        message,
    }
}

impl S3Store {
    pub async fn open(config: &StorageConfig) -> Result<Self, StorageError> {
        let StorageConfig::S3 {
            bucket,
            endpoint,
            region,
            path_style,
            access_key_id,
            secret_access_key,
            create_bucket,
            public_endpoint,
        } = config
        else {
            unreachable!("S3Store::open is only called with an S3 config");
        };
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new(region.clone()));
        if let (Some(id), Some(secret)) = (access_key_id, secret_access_key) {
            loader = loader.credentials_provider(aws_credential_types::Credentials::new(
                id,
                secret,
                None,
                None,
                "vnfarm-config",
            ));
        }
        if let Some(endpoint) = endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        let shared = loader.load().await;
        // The SDK's retries are off: `Retries` is the one policy (see `retry.rs` for why).
        let s3_config = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(*path_style)
            .retry_config(RetryConfig::disabled())
            .build();
        let client = Client::from_conf(s3_config);
        let presigner = match public_endpoint {
            Some(public) => Client::from_conf(
                aws_sdk_s3::config::Builder::from(&shared)
                    .endpoint_url(public)
                    .force_path_style(*path_style)
                    .build(),
            ),
            None => client.clone(),
        };
        let store = Self {
            client,
            presigner,
            bucket: bucket.clone(),
        };
        if *create_bucket {
            Retries::DEFAULT
                .run("create bucket", bucket, || store.create_bucket_if_missing())
                .await?;
        }
        Ok(store)
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    async fn create_bucket_if_missing(&self) -> Result<(), StorageError> {
        if self
            .client
            .head_bucket()
            .bucket(&self.bucket)
            .send()
            .await
            .is_ok()
        {
            return Ok(());
        }
        match self
            .client
            .create_bucket()
            .bucket(&self.bucket)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(SdkError::ServiceError(se))
                if matches!(
                    se.err().code(),
                    Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists")
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(unavailable("create bucket", &self.bucket, e)),
        }
    }

    pub async fn put(
        &self,
        key: &str,
        body: Bytes,
        content_type: &str,
    ) -> Result<(), StorageError> {
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_type(content_type)
            .body(ByteStream::from(body))
            .send()
            .await
            .map(|_| ())
            .map_err(|e| unavailable("put", key, e))
    }

    pub async fn exists(&self, key: &str) -> Result<bool, StorageError> {
        match self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
        {
            Ok(_) => Ok(true),
            Err(SdkError::ServiceError(se)) if se.err().is_not_found() => Ok(false),
            Err(e) => Err(unavailable("head", key, e)),
        }
    }

    pub async fn get(&self, key: &str) -> Result<Bytes, StorageError> {
        let out = match self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
        {
            Ok(out) => out,
            Err(SdkError::ServiceError(se)) if se.err().is_no_such_key() => {
                return Err(StorageError::NotFound {
                    key: key.to_owned(),
                });
            }
            Err(e) => return Err(unavailable("get", key, e)),
        };
        let data = out
            .body
            .collect()
            .await
            .map_err(|e| StorageError::Unavailable {
                op: "get",
                key: key.to_owned(),
                message: e.to_string(),
            })?;
        Ok(data.into_bytes())
    }

    /// A presigned GET URL of `key` (SigV4 query authentication; no request is made).
    pub async fn presigned_get(
        &self,
        key: &str,
        expires_in: std::time::Duration,
    ) -> Result<String, StorageError> {
        let config =
            aws_sdk_s3::presigning::PresigningConfig::expires_in(expires_in).map_err(|e| {
                StorageError::Unavailable {
                    op: "presign",
                    key: key.to_owned(),
                    message: e.to_string(),
                }
            })?;
        let request = self
            .presigner
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .presigned(config)
            .await
            .map_err(|e| unavailable("presign", key, e))?;
        Ok(request.uri().to_owned())
    }

    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError> {
        let mut keys = Vec::new();
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(prefix)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| unavailable("list", prefix, e))?;
            keys.extend(
                page.contents()
                    .iter()
                    .filter_map(|o| o.key().map(str::to_owned)),
            );
        }
        Ok(keys)
    }

    pub async fn check(&self) -> Result<(), StorageError> {
        self.client
            .head_bucket()
            .bucket(&self.bucket)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| unavailable("check", &self.bucket, e))
    }
}
