from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('finetuning', '0011_job_best_step'),
    ]

    operations = [
        migrations.AddField(
            model_name='finetuningjob',
            name='parent_revision',
            field=models.IntegerField(blank=True, null=True),
        ),
    ]
