//! An S3-compatible bucket through `aws-sdk-s3`: custom endpoint, path-style addressing and static
//! credentials for MinIO and other S3 servers, or the AWS default chain.

use aws_sdk_s3::Client;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use std::path::Path;

use aws_sdk_s3::primitives::{ByteStream, Length};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::Bytes;
use tokio::io::AsyncWriteExt as _;

use crate::{Retries, StorageConfig, StorageError};

/// The size of a multipart upload's parts (S3 allows 5 MiB to 5 GiB, and 10,000 parts: 640 GiB).
pub const MULTIPART_PART: u64 = 64 * 1024 * 1024;

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

    /// Uploads the file at `path` as `key`, read from disk as it is sent: one PUT up to
    /// [`MULTIPART_PART`], else a multipart upload of parts that size (aborted when a part fails,
    /// so no half object stays behind). A failed attempt starts over.
    pub async fn put_file(
        &self,
        key: &str,
        path: &Path,
        size: u64,
        content_type: &str,
    ) -> Result<(), StorageError> {
        let part = |offset: u64, length: u64| async move {
            ByteStream::read_from()
                .path(path)
                .offset(offset)
                .length(Length::Exact(length))
                .build()
                .await
                .map_err(|e| StorageError::Unavailable {
                    op: "put",
                    key: key.to_owned(),
                    message: format!("reading {}: {e}", path.display()),
                })
        };
        if size <= MULTIPART_PART {
            return self
                .client
                .put_object()
                .bucket(&self.bucket)
                .key(key)
                .content_type(content_type)
                .body(part(0, size).await?)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| unavailable("put", key, e));
        }
        let upload = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .content_type(content_type)
            .send()
            .await
            .map_err(|e| unavailable("put", key, e))?;
        let Some(upload_id) = upload.upload_id() else {
            return Err(StorageError::Unavailable {
                op: "put",
                key: key.to_owned(),
                message: "the multipart upload has no id".into(),
            });
        };
        let parts = async {
            let mut parts = Vec::new();
            let mut offset = 0;
            let mut number = 1;
            while offset < size {
                let length = MULTIPART_PART.min(size - offset);
                let sent = self
                    .client
                    .upload_part()
                    .bucket(&self.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .part_number(number)
                    .body(part(offset, length).await?)
                    .send()
                    .await
                    .map_err(|e| unavailable("put", key, e))?;
                parts.push(
                    CompletedPart::builder()
                        .part_number(number)
                        .set_e_tag(sent.e_tag().map(str::to_owned))
                        .build(),
                );
                offset += length;
                number += 1;
            }
            self.client
                .complete_multipart_upload()
                .bucket(&self.bucket)
                .key(key)
                .upload_id(upload_id)
                .multipart_upload(
                    CompletedMultipartUpload::builder()
                        .set_parts(Some(parts))
                        .build(),
                )
                .send()
                .await
                .map(|_| ())
                .map_err(|e| unavailable("put", key, e))
        }
        .await;
        if parts.is_err()
            && let Err(e) = self
                .client
                .abort_multipart_upload()
                .bucket(&self.bucket)
                .key(key)
                .upload_id(upload_id)
                .send()
                .await
        {
            tracing::warn!(key, error = %unavailable("abort upload", key, e), "a failed multipart upload was not aborted; the bucket's lifecycle rule must remove it");
        }
        parts
    }

    /// The size of `key` in bytes, `None` when there is no such object.
    pub async fn head(&self, key: &str) -> Result<Option<u64>, StorageError> {
        match self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
        {
            Ok(out) => Ok(Some(
                out.content_length()
                    .and_then(|n| u64::try_from(n).ok())
                    .unwrap_or(0),
            )),
            Err(SdkError::ServiceError(se)) if se.err().is_not_found() => Ok(None),
            Err(e) => Err(unavailable("head", key, e)),
        }
    }

    /// Appends bytes `offset..=last` of `key` (fewer where the object is shorter) to `file`, as
    /// they arrive; the bytes written. Nothing is written for an `offset` at or past the end.
    pub async fn get_range_into(
        &self,
        key: &str,
        offset: u64,
        last: u64,
        file: &mut tokio::fs::File,
    ) -> Result<u64, StorageError> {
        let out = match self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .range(format!("bytes={offset}-{last}"))
            .send()
            .await
        {
            Ok(out) => out,
            Err(SdkError::ServiceError(se)) if se.err().is_no_such_key() => {
                return Err(StorageError::NotFound {
                    key: key.to_owned(),
                });
            }
            // A range that starts past the end: the file already holds the whole object.
            Err(SdkError::ServiceError(se)) if se.err().code() == Some("InvalidRange") => {
                return Ok(0);
            }
            Err(e) => return Err(unavailable("get", key, e)),
        };
        let mut body = out.body;
        let mut written = 0;
        while let Some(chunk) = body
            .try_next()
            .await
            .map_err(|e| StorageError::Unavailable {
                op: "get",
                key: key.to_owned(),
                message: e.to_string(),
            })?
        {
            file.write_all(&chunk)
                .await
                .map_err(|e| crate::io_unavailable("get", key, e))?;
            written += chunk.len() as u64;
        }
        Ok(written)
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
